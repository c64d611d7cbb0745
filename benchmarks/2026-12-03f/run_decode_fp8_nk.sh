#!/usr/bin/env bash
# FP8 (W8A16, [E, out, in] experts) vs bf16 whole decode steps, V3 EP8-rank, c64 and c256, one process.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 540 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --kernels auto --fill random --steps 8 --warmup 2 \
  --weight-dtype fp8,bf16 --concurrency 64,256 --input-len 2000 --output-len 32 --json $OUT/decode_v3.json \
  > $OUT/decode_v3.txt 2>&1; echo "rc=$?" >> $OUT/decode_v3.txt
grep -E "===|floors|median|failed|rc=|Error" $OUT/decode_v3.txt | cut -c1-220
