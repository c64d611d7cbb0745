#!/bin/bash
# The sweep points still missing for issue 9, with the gather-tile attention (most wanted first; each
# point writes its JSON when it finishes and has its own time limit), then Step3 c64 again with the
# MFA selection change (32-head blocks at batch 64). Output in $OUT.
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
D="python scripts/bench_decode.py --fill random"
run() { local lim=$1; shift; echo "+ $*" >> $OUT/decode_run1.txt; timeout $lim $D "$@" >> $OUT/decode_run1.txt 2>&1 || echo "exit $?" >> $OUT/decode_run1.txt; }
run 170 --preset step3-ep8-rank --layers 12 --concurrency 1024 --input-len 4096 --output-len 8 --steps 4 --warmup 2 \
  --kernels auto,xla --json $OUT/decode_step3-ep8-rank_c1024.json
run 130 --preset deepseek-v2-lite --concurrency 1024 --input-len 2000 --output-len 8 --steps 4 --warmup 2 \
  --kernels auto --json $OUT/decode_deepseek-v2-lite_c1024.json
run 80 --preset step3-ep8-rank --concurrency 64 --input-len 4096 --output-len 20 --steps 10 --warmup 3 \
  --kernels auto --json $OUT/decode_step3-ep8-rank_c64.json
run 80 --preset deepseek-v3-ep8-rank --concurrency 64 --input-len 2000 --output-len 20 --steps 10 --warmup 3 \
  --kernels auto --json $OUT/decode_deepseek-v3-ep8-rank_c64.json
run 100 --preset deepseek-v3-ep8-rank --concurrency 512 --input-len 2000 --output-len 8 --steps 6 --warmup 2 \
  --kernels auto --json $OUT/decode_deepseek-v3-ep8-rank_c512.json
grep -E "^\+|floors|median step|exit|Error" $OUT/decode_run1.txt | cut -c1-220
