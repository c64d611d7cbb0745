#!/usr/bin/env bash
# Issue 30: the offline steps beside the served runs (same card, same model: DeepSeek-V2-Lite 27 layers, random
# weights): the decode step at c512 / c256 (context ~2000-2100) and prefix-hit vs fresh latency of one 2000-token prompt.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
for c in 512 256; do
  timeout 200 python3 scripts/bench_decode.py --preset deepseek-v2-lite --concurrency $c --input-len 2000 \
    --output-len 100 --steps 12 --warmup 3 --fill random --kernels auto --json $OUT/decode_c$c.json 2>&1 \
    | grep -vE "^W1|Warn" | tail -4 | tee $OUT/decode_c$c.txt
done
timeout 200 python3 benchmarks/2026-12-05b/prefix_hit.py 2>&1 | grep -vE "^W1|Warn" | tail -6 | tee $OUT/prefix_hit.txt
