#!/usr/bin/env bash
# FP8 vs bf16 whole decode steps at concurrency 64 (V3 EP8-rank) and 1024 (V2-Lite), one process each.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/device.txt
dec() {
  n=$1; t=$2; shift 2
  timeout $t python3 scripts/bench_decode.py --kernels auto --fill random --steps 8 --warmup 2 --weight-dtype bf16,fp8 \
    --input-len 2000 --output-len 32 --json $OUT/decode_${n}.json "$@" > $OUT/decode_${n}.txt 2>&1; echo "rc=$?" >> $OUT/decode_${n}.txt
  grep -E "floors|median|failed|rc=|Error" $OUT/decode_${n}.txt | cut -c1-220 | tail -8
}
dec deepseek-v3-ep8-rank_c64 290 --preset deepseek-v3-ep8-rank --concurrency 64
dec deepseek-v2-lite_c1024 260 --preset deepseek-v2-lite --concurrency 1024
