#!/bin/bash
# Decode points with the gather-tile attention: V2-Lite c1024, Step3 EP8-rank c256 (auto vs XLA).
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0
python scripts/sweep.py --offline --presets deepseek-v2-lite --concurrency 1024 --random-input-len 2000 \
  --random-output-len 8 --steps 4 --warmup-steps 2 --fill random --out-dir $OUT/sweep > $OUT/v2lite_c1024.txt 2>&1
python scripts/sweep.py --offline --presets step3-ep8-rank --concurrency 256 --random-input-len 4096 \
  --random-output-len 20 --steps 10 --warmup-steps 3 --fill random --out-dir $OUT/sweep3 > $OUT/step3_c256.txt 2>&1
tail -n 5 $OUT/v2lite_c1024.txt $OUT/step3_c256.txt
