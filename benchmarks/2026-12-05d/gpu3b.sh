#!/usr/bin/env bash
# Session 2026-12-05d, GPU call run right after gpu3.sh on the same machine (issue 31): the table
# at every point with the current selection and loop (bf16, FP8 "auto"; async engine loop) and, as the
# previous column, the previous selection and loop (bf16 and FP8 W8A16, synchronous loop); the FP8 step at
# 8 layers (per-layer slope for project_node.py); Step3 at 32 x 4096; the bf16 MoE kernel's tile sweep at
# 128 rows an expert. Results in $OUT/r.tgz, re-packed after every stage.
set -u
R=/tmp/r3b; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r3b; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
for ctx in 512 2048; do
  C=16,64,256; [ $ctx = 2048 ] && C=16,64,256,512
  timeout 110 $B --input-len $ctx --concurrency $C --weight-dtype bf16,fp8 --json $R/new$ctx.json > $R/new$ctx.txt 2>&1
  echo "new $ctx rc=$?"; pack
  timeout 110 $B --input-len $ctx --concurrency $C --weight-dtype bf16,fp8 --fp8-variant w8a16 --loop sync \
    --json $R/prev$ctx.json > $R/prev$ctx.txt 2>&1; echo "prev $ctx rc=$?"; pack
done
timeout 60 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 8 --fill random --kernels auto \
  --steps 10 --input-len 2048 --concurrency 128,256,512 --weight-dtype fp8 --json $R/l8.json > $R/l8.txt 2>&1
echo "l8 rc=$?"; pack
timeout 40 python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 32 --input-len 4096 \
  --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/step3.json > $R/step3.txt 2>&1
echo "step3 rc=$?"; pack
timeout 70 python3 scripts/bench_kernels.py --only moe --tokens 128 --moe-shapes v3-ep8 --sweep > $R/moe_sweep.txt 2>&1
echo "moe sweep rc=$?"; pack
