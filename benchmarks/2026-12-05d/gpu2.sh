#!/usr/bin/env bash
# Session 2026-12-05d, second GPU call (issue 31/32): the table at context 2048 (16/64/256/512)
# with bf16 and FP8 "auto", FP8 W8A16 (the previous selection) at 512 x 2048, Step3 at 32 x 4096 bf16 /
# FP8, and the MTP speculative step. Results in $OUT/r.tgz, re-packed after every stage.
set -u
R=/tmp/r2; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r2; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --input-len 2048 --fill random --kernels auto --steps 10"
timeout 230 $B --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --json $R/table2048.json > $R/table2048.txt 2>&1
echo "table2048 rc=$?"; pack
timeout 60 $B --concurrency 512 --weight-dtype fp8 --fp8-variant w8a16 --json $R/prev512.json > $R/prev512.txt 2>&1
echo "prev512 rc=$?"; pack
timeout 110 python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 32 --input-len 4096 \
  --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/step3.json > $R/step3.txt 2>&1
echo "step3 rc=$?"; pack
timeout 130 python3 scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --layers 4 --batch 16,256 --k 0,1,2 \
  --input-len 1000 --steps 10 --acceptance 0.6,0.8,0.9 --json $R/spec_decode.json > $R/spec_decode.txt 2>&1
echo "spec rc=$?"; pack
