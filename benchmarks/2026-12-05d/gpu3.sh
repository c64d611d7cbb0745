#!/usr/bin/env bash
# Session 2026-12-05d, third GPU call (issue 31), after: async loop by default, W8A8 experts from 64 rows
# an expert with 128 x 128 down tiles, FP8 experts dequantised to the bf16 kernel from 1024 rows an expert,
# 128 x 128 x 128 W8A8 dense tiles above 64 rows. Measures: the MLA decode kernel's tile sweep at 128 heads
# x 512 x 2048; the loop (sync / async / device step alone) at 512 x 2048 bf16; FP8 auto vs W8A16 (previous
# selection) vs bf16 at 256 and 512 x 2048; FP8 with forced Pallas W8A8 dense projections at 512; FP8
# prefill at 8 x 2048; the FP8 step's per-op profile. Results in $OUT/r.tgz, re-packed after every stage.
set -u
R=/tmp/r3; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r3; }
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 130 python3 scripts/bench_kernels.py --only mla --batch 512 --context 2048 --heads 128 --kv bf16 --sweep \
  --grid '{"tile":["gather"],"block_h":[32,64],"block_t":[32,64],"num_warps":[4,8],"num_stages":[2,3]}' \
  > $R/mla_sweep.txt 2>&1; echo "mla sweep rc=$?"; pack
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --input-len 2048 --fill random --kernels auto --steps 10"
timeout 70 $B --concurrency 512 --weight-dtype bf16 --host-overhead --json $R/loop512.json > $R/loop512.txt 2>&1
echo "loop rc=$?"; pack
timeout 80 $B --concurrency 256,512 --weight-dtype bf16,fp8 --json $R/d.json > $R/d.txt 2>&1; echo "d rc=$?"; pack
timeout 60 $B --concurrency 256,512 --weight-dtype fp8 --fp8-variant w8a16 --json $R/prev.json > $R/prev.txt 2>&1
echo "prev rc=$?"; pack
timeout 40 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --input-len 2048 --fill random \
  --kernels pallas --steps 10 --concurrency 512 --weight-dtype fp8 --fp8-variant w8a8 --json $R/w8a8dense.json \
  > $R/w8a8dense.txt 2>&1; echo "w8a8 dense rc=$?"; pack
timeout 100 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto \
  --weight-dtype bf16,fp8 --iters 5 --json $R/prefill.json > $R/prefill.txt 2>&1; echo "prefill rc=$?"; pack
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 55 python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank \
  --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype fp8 --steps 3 --top 30 \
  --json $R/prof_fp8.json > $R/prof_fp8.txt 2>&1; echo "prof rc=$?"; pack
