#!/bin/bash
# Second try (bench_decode now frees the first variant's cache before the next fills its own, and
# keeps what was measured when a variant fails): Step3 c1024 with its XLA baseline, then V2-Lite c1024.
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
D="python scripts/bench_decode.py --fill random"
run() { local lim=$1; shift; echo "+ $*" >> $OUT/decode_run2.txt; timeout $lim $D "$@" >> $OUT/decode_run2.txt 2>&1 || echo "exit $?" >> $OUT/decode_run2.txt; }
run 230 --preset step3-ep8-rank --layers 12 --concurrency 1024 --input-len 4096 --output-len 8 --steps 4 --warmup 2 \
  --kernels auto,xla --json $OUT/decode_step3-ep8-rank_c1024.json
run 270 --preset deepseek-v2-lite --concurrency 1024 --input-len 2000 --output-len 8 --steps 4 --warmup 2 \
  --kernels auto --json $OUT/decode_deepseek-v2-lite_c1024.json
grep -E "^\+|floors|median step|failed|exit|Error" $OUT/decode_run2.txt | cut -c1-220
