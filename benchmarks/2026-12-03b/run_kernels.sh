#!/bin/bash
# Kernel sweeps of the 2026-12-03 (later) session on one H200: page-id preload and value splits
# in the MLA/MFA pages kernel, down-projection tiles for the V2-Lite MoE. Output in $OUT.
set -x
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0
B=scripts/bench_kernels.py
python $B --only mla --batch 256 --context 2048 --heads 16 --kv bf16 --sweep --grid \
  '{"tile":["pages"],"block_h":[16],"block_t":[16,32],"num_warps":[4],"num_stages":[2,3],"preload_pages":[false,true],"num_splits":[1,2]}' \
  > $OUT/kernels_mla16_pages_sweep.txt 2>&1
python $B --only mla --batch 256 --context 2048 --heads 128 --kv bf16 --sweep --grid \
  '[{"tile":["pages"],"block_h":[16],"block_t":[16,32],"num_warps":[4],"num_stages":[2,3],"preload_pages":[true]},
    {"tile":["pages"],"block_h":[32,64],"block_t":[16],"value_splits":[2,4],"num_warps":[4,8],"num_stages":[2],"preload_pages":[true]}]' \
  > $OUT/kernels_mla128_pages_sweep.txt 2>&1
python $B --only mfa --batch 32 256 --sweep --grid \
  '[{"tile":["pages"],"block_h":[16],"block_t":[32],"num_warps":[4],"num_stages":[2],"preload_pages":[false,true],"num_splits":[1,2]},
    {"tile":["pages"],"block_h":[32,64],"block_t":[32],"value_splits":[2,4],"num_warps":[4,8],"num_stages":[2],"preload_pages":[true]}]' \
  > $OUT/kernels_mfa_pages_sweep.txt 2>&1
python $B --only moe --moe-shapes v2-lite --tokens 8 32 --sweep --grid \
  '{"block_n":[64,128],"block_k":[128,256],"block_n_down":[128,256],"block_k_down":[64,128],"num_stages":[3,4]}' \
  > $OUT/kernels_moe_v2lite_sweep.txt 2>&1
tail -n 3 $OUT/*.txt
