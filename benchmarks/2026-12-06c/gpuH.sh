#!/usr/bin/env bash
# GPU call H (2026-12-06c): activations quantised by one Triton kernel (act_quant_triton) in the Triton W8A8
# MoE; dense W8A8 GEMMs at M=512 (Pallas, Triton with 256-wide tiles); the FP8 step with each dense family.
set -u
R=/tmp/rH; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rH; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run pytest 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider tests/test_triton_fp8.py
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10 --input-len 2048 --weight-dtype fp8"
run step_pal 60 $B --concurrency 256,512 --json $R/step_pal.json
run step_tri 60 env MOEJAX_W8A8_DENSE_KERNEL=triton $B --concurrency 256,512 --json $R/step_tri.json
run gemm 200 python3 scripts/bench_fp8_kernels.py --only gemm --m 512 --triton-sweep --iters 10 --json $R/gemm.json
run moe 90 python3 scripts/bench_fp8_kernels.py --only moe --tokens 16 128 512 --iters 10 --json $R/moe.json
run prof 90 env MOEJAX_W8A8_DENSE_KERNEL=triton XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_step.py \
  --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype fp8 \
  --steps 3 --top 30 --json $R/prof.json
run step_pal2 60 $B --concurrency 256,512 --json $R/step_pal2.json
