#!/usr/bin/env bash
# Second call: the fp8-weight decode runs that the first call's 160 s limit cut off (bf16 measured there).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
dec() {
  n=$1; t=$2; shift 2
  timeout $t python3 scripts/bench_decode.py --kernels auto --fill random --steps 8 --warmup 2 --weight-dtype fp8 \
    --json $OUT/decode_${n}_fp8.json "$@" > $OUT/decode_${n}_fp8.txt 2>&1; echo "rc=$?" >> $OUT/decode_${n}_fp8.txt
  grep -E "floors|median|failed|rc=|Error" $OUT/decode_${n}_fp8.txt | cut -c1-220 | tail -6
}
dec deepseek-v3-ep8-rank_c256 260 --preset deepseek-v3-ep8-rank --concurrency 256 --input-len 2000 --output-len 32
dec deepseek-v2-lite_c256 200 --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 32
