#!/usr/bin/env bash
# Issue 16, continued: (1) the bf16 half of run1's V2-Lite comparison (run1's time limit cut it), same
# machine, next process; (2) V3 EP8-rank at c1024 with 12 layers (20 do not fit in bf16), fp8 and bf16 in one process.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
timeout 270 python3 scripts/bench_decode.py --preset deepseek-v2-lite --kernels auto --fill random --steps 6 --warmup 2 \
  --weight-dtype bf16 --concurrency 64,256,1024 --input-len 2000 --output-len 16 --json $R/decode_v2lite_bf16.json \
  > $R/decode_v2lite_bf16.txt 2>&1; echo "rc=$?" >> $R/decode_v2lite_bf16.txt
grep -E "===|floors|median|failed|rc=|Error" $R/decode_v2lite_bf16.txt | cut -c1-220
timeout 300 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 12 --kernels auto --fill random --steps 4 --warmup 2 \
  --weight-dtype fp8,bf16 --concurrency 1024 --input-len 2000 --output-len 8 --json $R/decode_v3_l12_c1024.json \
  > $R/decode_v3_l12_c1024.txt 2>&1; echo "rc=$?" >> $R/decode_v3_l12_c1024.txt
grep -E "===|floors|median|failed|rc=|Error" $R/decode_v3_l12_c1024.txt | cut -c1-220
cd /tmp && tar czf $OUT/run2.tgz res
