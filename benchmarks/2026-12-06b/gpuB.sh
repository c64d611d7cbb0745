#!/usr/bin/env bash
# GPU call B (2026-12-06b), after A: FP8 prefill with the Pallas W8A8 family, the 512 table, the FP8 step's profile at 512 x 2048, Step3 at the seed's point, the previous W8A8 selection.
set -u
R=/tmp/rB; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rB; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
P="python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto --iters 5"
run prof_bf16 80 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank \
  --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype bf16 --steps 3 --top 30 --json $R/prof_bf16.json
run new512 100 $B --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --json $R/new512.json
run step3 80 python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 32 --input-len 4096 \
  --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/step3.json
run prefill_pal 70 env MOEJAX_W8A8_KERNEL=pallas $P --weight-dtype fp8 --json $R/prefill_pal.json
run palw8a8 90 env MOEJAX_W8A8_KERNEL=pallas $B --input-len 2048 --concurrency 256,512 --weight-dtype fp8 --json $R/palw8a8.json
