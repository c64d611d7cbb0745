#!/usr/bin/env bash
# GPU call I (2026-12-06c): cuBLASLt's block-scaled FP8 GEMM through the XLA FFI (ffi/cuda): build, the scale
# layouts it reads, the dense GEMMs against bf16 / Pallas / Triton, the FP8 step and prefill with it.
set -u
R=/tmp/rI; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rI; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run build 120 bash ffi/cuda/build.sh
run probe 90 python3 benchmarks/2026-12-06c/probe_cublaslt.py
run gemm 150 python3 scripts/bench_fp8_kernels.py --only gemm --m 512 2048 16384 --iters 10 --json $R/gemm.json
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10 --input-len 2048 --weight-dtype fp8"
run step_cublt 70 env MOEJAX_W8A8_DENSE_KERNEL=cublaslt $B --concurrency 256,512 --json $R/step_cublt.json
run prefill_cublt 90 env MOEJAX_W8A8_DENSE_KERNEL=cublaslt python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank \
  --layers 4 --points 8x2048 --kernels auto --iters 5 --weight-dtype fp8 --json $R/prefill_cublt.json
run step_pal 70 $B --concurrency 256,512 --json $R/step_pal.json
