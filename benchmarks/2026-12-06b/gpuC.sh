#!/usr/bin/env bash
# GPU call C (2026-12-06b): call A cut to what fits the device time left after nine failed starts: the
# Triton MLA kernel's tests on the device, its kernel sweep against the Pallas kernel (bf16 cache), and
# the step at 256 / 512 x 2048 with each MLA kernel (bf16 and FP8 weights), then the rest of A's table.
set -u
R=/tmp/rC; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rC; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run pytest 70 env JAX_PLATFORMS=cuda python3 -m pytest -q -o addopts="" tests/test_triton_mla_decode.py
run mla 80 python3 scripts/bench_kernels.py --only mla --batch 512 256 --context 2048 --heads 128 --kv bf16 --sweep \
  --grid '[{"kernel":["pallas"]},{"kernel":["triton"],"block_h":[64],"block_n":[32,64],"num_warps":[8],"num_stages":[2]}]'
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
run tri 70 $B --input-len 2048 --concurrency 512,256 --weight-dtype bf16,fp8 --json $R/tri.json
run pal 70 env MOEJAX_MLA_KERNEL=pallas $B --input-len 2048 --concurrency 512,256 --weight-dtype bf16,fp8 --json $R/pal.json
run tri_small 80 $B --input-len 2048 --concurrency 16,64 --weight-dtype bf16,fp8 --json $R/tri_small.json
run mla_fp8 60 python3 scripts/bench_kernels.py --only mla --batch 512 --context 2048 --heads 128 --kv fp8 --sweep --sweep-kv fp8 \
  --grid '[{"kernel":["triton"],"block_h":[64],"block_n":[32,64],"num_warps":[8],"num_stages":[2]}]'
