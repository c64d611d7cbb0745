#!/usr/bin/env bash
# FP8 fused MoE at the V3 EP8-rank shape: [E, in, out] vs HF's [E, out, in] weights, bf16 vs f16 dots.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/device.txt
timeout 420 python3 scripts/bench_fp8_kernels.py --only moe --tokens 8 32 128 --layouts --sweep --iters 20 \
  --json $OUT/moe_layouts.json > $OUT/moe_layouts.txt 2>&1; echo "rc=$?" >> $OUT/moe_layouts.txt
grep -vE "^\s*$" $OUT/moe_layouts.txt | cut -c1-150 | tail -90
