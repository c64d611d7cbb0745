#!/usr/bin/env bash
# Session 2026-12-05d, first GPU call (issue 31): last session's fp8_gpu.sh (W8A8 tile sweep, decode
# step at 512 x 2048 bf16 / FP8 auto / FP8 W8A8, bf16 per-op profile), the table at context 512
# (16/64/256 sequences) with bf16 and FP8 "auto", and FP8 prefill at 8 x 2048. Results in $OUT/r.tgz,
# re-packed after every stage (a call stopped at its limit keeps what finished).
set -u
R=/tmp/r; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 110 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto \
  --weight-dtype bf16,fp8 --iters 5 --json $R/prefill_fp8.json > $R/prefill_fp8.txt 2>&1; echo "prefill rc=$?"; pack
OUT=$R bash benchmarks/2026-12-05c/fp8_gpu.sh 2>&1 | tee $R/fp8_gpu.log; pack
timeout 140 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 16,64,256 \
  --input-len 512 --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/table512.json \
  > $R/table512.txt 2>&1; echo "table512 rc=$?"; pack
