#!/usr/bin/env bash
# Issue 16 on one H200: FP8 kernels vs bf16, then whole decode steps bf16 vs fp8 weights (one process
# per preset/concurrency; the two weight formats run one after the other in that process).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee $OUT/device.txt
timeout 200 python3 scripts/bench_fp8_kernels.py --json $OUT/kernels_fp8.json > $OUT/kernels_fp8.txt 2>&1; echo "kernels rc=$?" >> $OUT/kernels_fp8.txt
tail -40 $OUT/kernels_fp8.txt
run() {  # name, args...
  n=$1; shift
  timeout 170 python3 scripts/bench_decode.py --kernels auto --fill random --steps 8 --warmup 2 --weight-dtype bf16,fp8 \
    --json $OUT/decode_$n.json "$@" > $OUT/decode_$n.txt 2>&1; echo "rc=$?" >> $OUT/decode_$n.txt
  grep -E "floors|median|failed|rc=|Error" $OUT/decode_$n.txt | tail -8
}
run deepseek-v3-ep8-rank_c256 --preset deepseek-v3-ep8-rank --concurrency 256 --input-len 2000 --output-len 32
run deepseek-v2-lite_c256 --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 32
