#!/usr/bin/env bash
# Issue 18: (1) V2-Lite 8 layers c256: shared-expert fusion on/off x moejax's XLA flags on/off (the 27-layer
# step measured 29.0 ms today against 23.0 ms on the first run); (2) host overhead at c1024, 8 layers.
# Issue 21: DBO on at 256 tokens per rank under the mock topology (run 3's watchdog cut it).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 75 python3 scripts/dbo_schedule.py --mock-topology 1x8x1 --preset deepseek-v3 --layers 3 --batch 256 --dbo on \
  --ctx 2000 --steps 10 --watchdog 70 --dump /tmp/dump --json $OUT/dbo_mock_b256.json 2>&1 | grep -vE "^W1|Warn|^  File" | head -30
(cd /tmp && tar czf $OUT/dbo_dump_b256.tgz dump 2>/dev/null)
timeout 90 python3 benchmarks/2026-12-04b/fuse_regress.py 8 256 flags 2>&1 | grep -E "fuse|Error"
XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_experimental_parallel_collective_overlap_limit=1" \
  timeout 90 python3 benchmarks/2026-12-04b/fuse_regress.py 8 256 noflags 2>&1 | grep -E "fuse|Error"
timeout 110 python3 scripts/bench_decode.py --preset deepseek-v2-lite --layers 8 --concurrency 1024 --input-len 2000 \
  --output-len 28 --steps 8 --warmup 2 --fill random --kernels auto --host-overhead --json $OUT/host_overhead.json \
  2>&1 | grep -vE "^W1|Warn" | tee $OUT/host_overhead.txt
