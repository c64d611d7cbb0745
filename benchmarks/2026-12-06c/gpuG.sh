#!/usr/bin/env bash
# GPU call G (2026-12-06c): the Triton-language bf16 fused MoE against the Pallas kernel (kernel sweep at the
# V3 EP8-rank and Step3 shares), then the 4-layer V3 step at 256 / 512 x 2048 with each (MOEJAX_MOE_KERNEL).
set -u
R=/tmp/rG; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rG; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
K="python3 scripts/bench_kernels.py --only moe --sweep --grid {\"num_stages\":[3]}"
run kern_v3 200 $K --moe-shapes v3-ep8 --tokens 16 128 512
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10 --input-len 2048 --weight-dtype bf16"
for k in triton pallas; do run step_$k 60 env MOEJAX_MOE_KERNEL=$k $B --concurrency 256,512 --json $R/step_$k.json; done
run kern_s3 90 $K --moe-shapes step3-ep8 --tokens 16 128
run step_triton2 60 env MOEJAX_MOE_KERNEL=triton $B --concurrency 256,512 --json $R/step_triton2.json
