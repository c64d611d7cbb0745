#!/usr/bin/env bash
# GPU call D (2026-12-06b), the device time left after C: the Triton MLA kernel now selected for FP8 caches
# (64+ heads) only; the step at 512 x 2048 over an FP8 cache with it and with the previous choice there
# (XLA: MOEJAX_MLA_KERNEL=pallas keeps the Pallas family, which hands FP8 at 128 heads to XLA), then FP8 prefill.
set -u
R=/tmp/rD; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rD; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --fill random --kernels auto --steps 10 --kv-dtype fp8"
run kvfp8_tri 50 $B --input-len 2048 --concurrency 512 --weight-dtype bf16 --json $R/kvfp8_tri.json
run kvfp8_xla 50 env MOEJAX_MLA_KERNEL=pallas $B --input-len 2048 --concurrency 512 --weight-dtype bf16 --json $R/kvfp8_xla.json
run prefill 90 python3 scripts/bench_prefill.py --preset deepseek-v3-ep8-rank --layers 4 --points 8x2048 --kernels auto \
  --iters 5 --weight-dtype bf16,fp8 --json $R/prefill.json
