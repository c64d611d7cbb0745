#!/usr/bin/env bash
# Issue 31 on one GPU after FP8 dots moved to wgmma: W8A8 tile sweep, the V3 EP8-rank decode step
# (4 layers) at 512 x 2048 with bf16 / FP8 W8A16 / FP8 W8A8 weights, and the bf16 step's per-op profile
# with XLA's command buffers off (with them the trace shows one command_buffer op for the whole step).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 110 python3 benchmarks/2026-12-05c/fp8_tiles.py --iters 10 --out $OUT/fp8_tiles.json > $OUT/fp8_tiles.txt 2>&1; echo "tiles rc=$?"
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 --input-len 2048 --fill random --kernels auto --steps 10"
timeout 75 $B --weight-dtype bf16,fp8 --json $OUT/decode_w8a16.json > $OUT/decode_w8a16.txt 2>&1; echo "decode w8a16 rc=$?"
timeout 50 $B --weight-dtype fp8 --fp8-variant w8a8 --json $OUT/decode_w8a8.json > $OUT/decode_w8a8.txt 2>&1; echo "decode w8a8 rc=$?"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 55 python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank --layers 4 \
  --concurrency 512 --input-len 2048 --kernels auto --weight-dtype bf16 --steps 3 --top 30 --json $OUT/prof_bf16.json \
  > $OUT/prof_bf16.txt 2>&1; echo "prof rc=$?"
