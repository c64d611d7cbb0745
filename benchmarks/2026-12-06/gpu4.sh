#!/usr/bin/env bash
# GPU call 4 (call 3 cut for device time: the budget's last ~250 s): the selection after call 2 at the
# compute-bound points first (bf16 and FP8 at 256 / 512 x 2048), FP8 prefill 8 x 2048, then the small points.
set -u
R=/tmp/r4; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r4; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10"
run big 90 $B --input-len 2048 --concurrency 256,512 --weight-dtype bf16,fp8 --json $R/big.json
run prefill 70 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto \
  --iters 5 --weight-dtype bf16,fp8 --json $R/prefill.json
run small 90 $B --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --json $R/small.json
