#!/bin/bash
# Final run of the session (device time nearly spent: most important first; each point writes its
# JSON as it finishes). Decode with the gather-tile attention; the XLA baselines of points run
# before are not repeated (the XLA path did not change since 2026-12-03's baselines).
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0
D="python scripts/bench_decode.py --fill random"
$D --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 20 --steps 10 --warmup 3 \
  --kernels auto --components --json $OUT/decode_deepseek-v2-lite_c256.json >> $OUT/decode_run_final.txt 2>&1
python scripts/bench_kernels.py --only mla --batch 64 256 --context 2048 8192 --heads 128 16 --kv bf16 fp8 \
  > $OUT/kernels_mla_selected.txt 2>&1
$D --preset step3-ep8-rank --concurrency 512 --input-len 4096 --output-len 20 --steps 6 --warmup 2 \
  --kernels auto,xla --json $OUT/decode_step3-ep8-rank_c512.json >> $OUT/decode_run_final.txt 2>&1
$D --preset deepseek-v3-ep8-rank --concurrency 256 --input-len 2000 --output-len 20 --steps 10 --warmup 3 \
  --kernels auto --json $OUT/decode_deepseek-v3-ep8-rank_c256.json >> $OUT/decode_run_final.txt 2>&1
python scripts/bench_kernels.py --only mfa --batch 32 64 256 > $OUT/kernels_mfa_selected.txt 2>&1
$D --preset deepseek-v2-lite --concurrency 1024 --input-len 2000 --output-len 8 --steps 4 --warmup 2 \
  --kernels auto --json $OUT/decode_deepseek-v2-lite_c1024.json >> $OUT/decode_run_final.txt 2>&1
grep -E "floors|median step|components|Error|error" $OUT/decode_run_final.txt | tail -30
