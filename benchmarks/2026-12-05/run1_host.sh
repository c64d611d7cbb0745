#!/usr/bin/env bash
# Issue 18 on the H200: (1) the decode input building, old per-row loop vs NumPy (host CPU only);
# (2) host overhead of the synchronous and overlapped loops at 27 layers (the point not run before), c64 and c1024.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1

JAX_PLATFORMS=cpu timeout 120 python3 benchmarks/2026-12-05/host_inputs_ab.py 1024 1900 2>&1 | grep -E "host work|Error" | tee $OUT/host_inputs_ab.txt
for c in 1024 64; do
  timeout 240 python3 scripts/bench_decode.py --preset deepseek-v2-lite --concurrency $c --input-len 2000 \
    --output-len 40 --steps 12 --warmup 3 --fill random --kernels auto --host-overhead --json $OUT/host_overhead_27L_c$c.json \
    2>&1 | grep -vE "^W1|Warn" | tail -8 | tee $OUT/host_overhead_27L_c$c.txt
done
