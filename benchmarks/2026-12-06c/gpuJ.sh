#!/usr/bin/env bash
# GPU call J (2026-12-06c): cuBLASLt's FP8 GEMM selected for W8A8 dense projections (scale layout fixed after
# call I): GPU tests, the FP8 table at 2048 (bf16 at 256 / 512 beside it), FP8 prefill, the FP8 profile,
# 8-layer FP8 steps for project_node.py, the FP8 512-context table.
set -u
R=/tmp/rJ; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rJ; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run build 120 bash ffi/cuda/build.sh
run pytest 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider tests/test_cublaslt_fp8_gemm.py tests/test_triton_fp8.py
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --fill random --kernels auto --steps 10"
run t2048 120 $B --layers 4 --input-len 2048 --concurrency 16,64,256,512 --weight-dtype fp8 --json $R/t2048.json
run bf16 60 $B --layers 4 --input-len 2048 --concurrency 256,512 --weight-dtype bf16 --json $R/bf16.json
run prefill 120 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto \
  --iters 5 --weight-dtype bf16,fp8 --json $R/prefill.json
run prof 90 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank \
  --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype fp8 --steps 3 --top 30 --json $R/prof.json
run v3l8 120 $B --layers 8 --input-len 2048 --concurrency 128,256,512 --weight-dtype fp8 --json $R/v3l8.json
run t512 90 $B --layers 4 --input-len 512 --concurrency 16,64,256 --weight-dtype fp8 --json $R/t512.json
