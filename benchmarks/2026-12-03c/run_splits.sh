#!/bin/bash
# Hypothesis: at 16 heads and batch 256 the selected decode kernel runs one program per sequence
# (256 programs, 2 per SM, 4 warps each: one 144 KB two-stage 64-token tile fits per SM), too few
# warps in flight to cover DRAM latency. Sweep context splits (more programs), tile length and
# stages in one process. Output in $OUT.
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
B=scripts/bench_kernels.py
python $B --only mla --batch 64 256 --context 2048 --heads 16 --kv bf16 --sweep --grid \
  '{"tile":["gather"],"block_h":[16],"block_t":[32,64],"num_warps":[4],"num_stages":[2,3],"num_splits":[1,2,4,8]}' \
  > $OUT/kernels_mla16_splits_sweep.txt 2>&1
python $B --only mla --batch 256 --context 8192 --heads 16 --kv bf16 --sweep --grid \
  '{"tile":["gather"],"block_h":[16],"block_t":[32,64],"num_warps":[4],"num_stages":[2],"num_splits":[1,2,4,8]}' \
  > $OUT/kernels_mla16_8k_splits_sweep.txt 2>&1
python $B --only mla --batch 64 256 --context 2048 --heads 128 --kv bf16 --sweep --grid \
  '{"tile":["gather"],"block_h":[32],"block_t":[32,64],"num_warps":[4],"num_stages":[2,3],"num_splits":[1,2,4]}' \
  > $OUT/kernels_mla128_splits_sweep.txt 2>&1
python $B --only mfa --batch 64 256 --sweep --grid \
  '{"tile":["gather"],"block_h":[16,32],"block_t":[32,64],"num_warps":[4],"num_stages":[2],"num_splits":[1,2,4]}' \
  > $OUT/kernels_mfa_splits_sweep.txt 2>&1
for f in $OUT/kernels_*_splits_sweep.txt; do echo "== $f"; grep -E "measured|selected" $f | cut -c1-200;
  grep -v failed $f | grep "{" | sort -k5 -g | cut -c1-200 | head -5; done
