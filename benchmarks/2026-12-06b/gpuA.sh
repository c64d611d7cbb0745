#!/usr/bin/env bash
# GPU call A (2026-12-06b): the Triton MLA decode kernel (tests on the device, kernel sweep against the
# Pallas kernel at 128 heads), then the 2048 table with the new selection and with the Pallas MLA
# kernel (the previous selection's attention) at 256 and 512, FP8 prefill.
set -u
R=/tmp/rA; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rA; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run pytest 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -o addopts="" tests/test_triton_mla_decode.py tests/test_triton_fp8.py
run mla 150 python3 scripts/bench_kernels.py --only mla --batch 256 512 --context 2048 --heads 128 --kv bf16 fp8 --sweep --sweep-kv bf16 fp8 \
  --grid '[{"kernel":["pallas"]},{"kernel":["triton"],"block_h":[64],"block_n":[32,64],"num_warps":[8],"num_stages":[2,3]}]'
#  (fp8 cache: the Pallas page tile and Triton; "auto" keeps XLA there: the xla column)
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
run new2048 130 $B --input-len 2048 --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --json $R/new2048.json
run palmla2048 90 env MOEJAX_MLA_KERNEL=pallas $B --input-len 2048 --concurrency 256,512 --weight-dtype bf16,fp8 --json $R/palmla2048.json
P="python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto --iters 5"
run prefill 80 $P --weight-dtype bf16,fp8 --json $R/prefill.json
