#!/usr/bin/env bash
# Issue 18: host overhead of the engine's decode loop, synchronous vs overlapped (async scheduling), against
# the compiled step alone; V2-Lite with 6 layers (the session's last device minutes), c256, input 2000.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 165 python3 scripts/bench_decode.py --preset deepseek-v2-lite --layers 6 --concurrency 256 --input-len 2000 \
  --output-len 24 --steps 8 --warmup 2 --fill random --kernels auto --host-overhead --json $OUT/host_overhead.json \
  2>&1 | grep -vE "^W1|Warn" | tee $OUT/host_overhead.txt; echo "rc=${PIPESTATUS[0]}" | tee -a $OUT/host_overhead.txt
