#!/usr/bin/env bash
# GPU call 2: call 1 again where it failed (pip had installed jax-triton for another Python; the tests ran
# on CPU under conftest's JAX_PLATFORMS=cpu): tests on the GPU, kernel timings with the Triton kernels, and
# the FP8 step with each W8A8 kernel family, alternating.
set -u
R=/tmp/r2; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r2; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
python3 -c "import jax_triton, triton, jax; print(jax_triton.__version__, triton.__version__, jax.__version__)" >> $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run pytest 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -o addopts="" tests/test_triton_fp8.py
run kern 300 python3 scripts/bench_fp8_kernels.py --tokens 16 64 128 512 --m 128 512 2048 --triton-sweep --iters 20 \
  --json $R/kern.json
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
for i in 1 2; do
  for k in pallas triton; do
    run step_${k}_$i 120 env MOEJAX_W8A8_KERNEL=$k $B --input-len 2048 --concurrency 256,512 --weight-dtype fp8 \
      --json $R/step_${k}_$i.json
  done
done
