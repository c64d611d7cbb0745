#!/bin/bash
# Third call (sent inline as this command): V3 EP8-rank c64 and c512 with the gather-tile attention.
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1; D="python scripts/bench_decode.py --fill random"
timeout 170 $D --preset deepseek-v3-ep8-rank --concurrency 64 --input-len 2000 --output-len 20 --steps 8 --warmup 2 --kernels auto --json $OUT/decode_deepseek-v3-ep8-rank_c64.json 2>&1 | grep -v ^W12
timeout 200 $D --preset deepseek-v3-ep8-rank --concurrency 512 --input-len 2000 --output-len 8 --steps 5 --warmup 2 --kernels auto --json $OUT/decode_deepseek-v3-ep8-rank_c512.json 2>&1 | grep -v ^W12
