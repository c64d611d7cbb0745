#!/usr/bin/env bash
# (1) FP8 only in the experts (routed + shared; attention and dense bf16) vs bf16, V3 EP8-rank, c64/c256.
# (2) Prefill, deepseek-v2-lite (27 layers): flash (auto) vs the full-score path.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 350 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --kernels auto --fill random --steps 8 --warmup 2 \
  --weight-dtype fp8:experts+shared_experts,bf16 --concurrency 64,256 --input-len 2000 --output-len 32 \
  --json $OUT/decode_v3_policy.json > $OUT/decode_v3_policy.txt 2>&1; echo "rc=$?" >> $OUT/decode_v3_policy.txt
grep -E "===|floors|median|failed|rc=|Error" $OUT/decode_v3_policy.txt | cut -c1-220
timeout 200 python3 scripts/bench_prefill.py --preset deepseek-v2-lite --points 1x2048,8x2048,32x2048 --kernels auto,full \
  --iters 3 --json $OUT/prefill_v2lite.json > $OUT/prefill_v2lite.txt 2>&1; echo "rc=$?" >> $OUT/prefill_v2lite.txt
tail -25 $OUT/prefill_v2lite.txt | cut -c1-240
