#!/bin/bash
# Gather tile with masked loads (block_t tokens across pages in one dot) vs the pages tile, MLA
# 16/128 heads and Step3 MFA; MoE down-projection tiles at all three shapes. Output in $OUT.
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0
B=scripts/bench_kernels.py
python $B --only mla --batch 256 --context 2048 --heads 16 --kv bf16 --sweep --grid \
  '[{"tile":["gather"],"block_h":[16],"block_t":[32,64,128],"num_warps":[4,8],"num_stages":[2,3]},
    {"tile":["gather"],"block_h":[16],"block_t":[64],"num_warps":[4],"num_stages":[2,3],"num_splits":[2]}]' > $OUT/kernels_mla16_gather_sweep.txt 2>&1
python $B --only mla --batch 256 --context 2048 --heads 128 --kv bf16 --sweep --grid \
  '[{"tile":["gather"],"block_h":[16,32],"block_t":[32,64],"num_warps":[4,8],"num_stages":[2,3]},
    {"tile":["gather"],"block_h":[64],"block_t":[32],"num_warps":[8],"num_stages":[2]}]' > $OUT/kernels_mla128_gather_sweep.txt 2>&1
python $B --only mfa --batch 32 256 --sweep --grid \
  '{"tile":["gather"],"block_h":[16,32],"block_t":[32,64],"num_warps":[4,8],"num_stages":[2]}' > $OUT/kernels_mfa_gather_sweep.txt 2>&1
python $B --only moe --moe-shapes v3-ep8 v2-lite step3-ep8 --tokens 8 32 --sweep --grid \
  '{"block_n_down":[64,128],"block_k_down":[64,128]}' > $OUT/kernels_moe_down_sweep.txt 2>&1
for f in $OUT/kernels_*_gather_sweep.txt $OUT/kernels_moe_down_sweep.txt; do echo "== $f"; grep -v failed $f | sort -k5 -n -t' ' | cut -c1-230 | head -8; done
