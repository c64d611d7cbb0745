#!/usr/bin/env bash
# Session 2026-12-05d, the GPU call after this session's changes (issue 31), most important first (device
# time was short: the call may be cut): the table at every point, current selection and loop
# (bf16 and FP8 "auto", async loop) then the previous ones (bf16 and FP8 W8A16, synchronous loop); FP8
# prefill; the MLA decode tile sweep at 128 heads x 512 x 2048; the loop's host overhead at 512 x 2048;
# Step3 at 32 x 4096; the FP8 step at 8 layers (per-layer slope); the FP8 step's profile; forced Pallas
# W8A8 dense projections; the bf16 MoE tile sweep at 128 rows an expert. $OUT/r.tgz after every stage.
set -u
R=/tmp/r3; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r3; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run new512 90 $B --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --json $R/new512.json
run new2048 110 $B --input-len 2048 --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --json $R/new2048.json
run prev512 90 $B --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --fp8-variant w8a16 --loop sync --json $R/prev512.json
run prev2048 110 $B --input-len 2048 --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --fp8-variant w8a16 --loop sync --json $R/prev2048.json
run prefill 90 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto \
  --weight-dtype bf16,fp8 --iters 5 --json $R/prefill.json
run mla_sweep 120 python3 scripts/bench_kernels.py --only mla --batch 512 --context 2048 --heads 128 --kv bf16 --sweep \
  --grid '{"tile":["gather"],"block_h":[32,64],"block_t":[32,64],"num_warps":[4,8],"num_stages":[2,3]}'
run loop512 70 $B --input-len 2048 --concurrency 512 --weight-dtype bf16 --host-overhead --json $R/loop512.json
run step3 40 python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 32 --input-len 4096 \
  --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/step3.json
run l8 60 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 8 --fill random --kernels auto \
  --steps 10 --input-len 2048 --concurrency 128,256,512 --weight-dtype fp8 --json $R/l8.json
run prof_fp8 55 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank \
  --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype fp8 --steps 3 --top 30 --json $R/prof_fp8.json
run w8a8dense 40 python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --input-len 2048 --fill random \
  --kernels pallas --steps 10 --concurrency 512 --weight-dtype fp8 --fp8-variant w8a8 --json $R/w8a8dense.json
run moe_sweep 70 python3 scripts/bench_kernels.py --only moe --tokens 128 --moe-shapes v3-ep8 --sweep
