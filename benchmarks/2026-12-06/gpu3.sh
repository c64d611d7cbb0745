#!/usr/bin/env bash
# GPU call 3: the selection after call 2 (Triton W8A8 experts from 16 rows an expert, no dequantised-bf16
# range, tiles from the call-2 sweep; dense on Pallas): GPU tests, the table (bf16, fp8), FP8
# prefill with each W8A8 family, the FP8 step's profile at 512 x 2048 (Step3 dropped: device time).
set -u
R=/tmp/r3; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r3; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run pytest 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -o addopts="" tests/test_triton_fp8.py
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
P="python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto --iters 5"
run new2048 130 $B --input-len 2048 --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --json $R/new2048.json
run prefill 100 $P --weight-dtype bf16,fp8 --json $R/prefill.json
run new512 100 $B --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --json $R/new512.json
run prof_fp8 70 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank \
  --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype fp8 --steps 3 --top 30 --json $R/prof_fp8.json
run prefill_pal 70 env MOEJAX_W8A8_KERNEL=pallas $P --weight-dtype fp8 --json $R/prefill_pal.json
# Added at the run (2026-12-06 session): Step3 FP8 at the seed's point, and the previous selection (Pallas W8A8
# family, its thresholds) as the table's column at 2048 (whatever of it fits under the call's 10 minutes).
run step3 80 python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 32 --input-len 4096 \
  --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/step3.json
run pal2048 90 env MOEJAX_W8A8_KERNEL=pallas $B --input-len 2048 --concurrency 16,64,256,512 --weight-dtype fp8 --json $R/pal2048.json
