#!/usr/bin/env bash
# GPU call K (2026-12-06c): which shapes cuBLASLt's GEMM gets wrong; 512 x 2048 bf16 / FP8 again (call J's
# FP8 512 point was an outlier: p90 22 ms).
set -u
R=/tmp/rK; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rK; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run build 60 bash ffi/cuda/build.sh
run probe2 40 python3 benchmarks/2026-12-06c/probe2_cublaslt.py
run s512 70 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --fill random --kernels auto --steps 10 \
  --layers 4 --input-len 2048 --concurrency 512 --weight-dtype fp8,bf16 --json $R/s512.json
