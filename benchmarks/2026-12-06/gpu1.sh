#!/usr/bin/env bash
# Session 2026-12-06 (issue 31), GPU call 1: jax-triton on the device (jax-triton 0.3.1 carried as a wheel,
# triton 3.6.0 from the image's torch); the Triton W8A8 kernels against float64 on the GPU; their tiles
# against the Pallas kernels (bench_fp8_kernels.py --triton-sweep); then the table with the
# selection as it stood at the start of this session; the decode step with either W8A8 kernel family. $OUT/r.tgz after every stage.
set -u
R=/tmp/r1; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r1; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
python3 -c "import jax_triton, triton, jax; print(jax_triton.__version__, triton.__version__, jax.__version__)" >> $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run pytest 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -o addopts="" tests/test_triton_fp8.py
run kern 240 python3 scripts/bench_fp8_kernels.py --tokens 16 64 128 512 --m 128 512 2048 --triton-sweep --iters 20 \
  --json $R/kern.json
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
# FP8 at the compute-bound points with the W8A8 GEMMs on each kernel family (the selection's thresholds
# unchanged), alternating; then the whole table with the session-start selection (Pallas W8A8).
for i in 1 2; do
  for k in pallas triton; do
    run step_${k}_$i 120 env MOEJAX_W8A8_KERNEL=$k $B --input-len 2048 --concurrency 256,512 --weight-dtype fp8 \
      --json $R/step_${k}_$i.json
  done
done
run pal2048 110 env MOEJAX_W8A8_KERNEL=pallas $B --input-len 2048 --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --json $R/pal2048.json
run pal512 90 env MOEJAX_W8A8_KERNEL=pallas $B --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --json $R/pal512.json
