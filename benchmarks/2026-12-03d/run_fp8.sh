#!/usr/bin/env bash
# One H200 call: FP8 kernels vs bf16 (issue 16), V3-rank decode bf16 vs fp8 weights (same process),
# prefill at V3-rank shapes (issue 17), V2-Lite decode bf16 vs fp8.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout 150 python3 scripts/bench_fp8_kernels.py --json $OUT/kernels_fp8.json > $OUT/kernels_fp8.txt 2>&1; echo "kernels rc=$?" >> $OUT/kernels_fp8.txt
grep -vE "^\s*$" $OUT/kernels_fp8.txt | cut -c1-150 | tail -32
dec() {  # name, args...
  n=$1; shift
  timeout 160 python3 scripts/bench_decode.py --kernels auto --fill random --steps 8 --warmup 2 --weight-dtype bf16,fp8 \
    --json $OUT/decode_$n.json "$@" > $OUT/decode_$n.txt 2>&1; echo "rc=$?" >> $OUT/decode_$n.txt
  grep -E "floors|median|failed|rc=|Error" $OUT/decode_$n.txt | cut -c1-220 | tail -6
}
dec deepseek-v3-ep8-rank_c256 --preset deepseek-v3-ep8-rank --concurrency 256 --input-len 2000 --output-len 32
timeout 130 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 1x2048,8x2048,1x32768 \
  --kernels auto,full --iters 3 --json $OUT/prefill_deepseek-v3-ep8-rank_l4.json > $OUT/prefill_deepseek-v3-ep8-rank_l4.txt 2>&1; echo "rc=$?" >> $OUT/prefill_deepseek-v3-ep8-rank_l4.txt
grep -vE "^\s*$" $OUT/prefill_deepseek-v3-ep8-rank_l4.txt | cut -c1-200 | tail -14
dec deepseek-v2-lite_c256 --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 32
