#!/usr/bin/env bash
# Issue 18: host-loop phases (sync vs async) on V2-Lite with 4 layers at c256 and c1024.
# Issue 21: the dp8-ep8 decode step under JAX's mock GPU topology (8 devices, 1 local): compiled
# schedule and per-rank time, DBO off/on, DeepSeek-V3 shapes with 4 layers, 64 and 256 tokens per rank.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/device.txt 2>&1
timeout 200 python3 benchmarks/2026-12-04b/host_phases.py 4 256 2>&1 | grep -vE "^W1|Warn" | tee $OUT/host_phases_c256.txt
mv $OUT/host_phases.json $OUT/host_phases_c256.json 2>/dev/null
timeout 150 python3 scripts/dbo_schedule.py --mock-topology 1x8x1 --preset deepseek-v3 --layers 4 --batch 64,256 \
  --ctx 2000 --steps 10 --dump /tmp/dump --json $OUT/dbo_mock.json 2>&1 | grep -vE "^W1|Warn" | tee $OUT/dbo_mock.txt
echo "rc=${PIPESTATUS[0]}" | tee -a $OUT/dbo_mock.txt
(cd /tmp && tar czf $OUT/dbo_dump.tgz dump 2>/dev/null)
timeout 150 python3 benchmarks/2026-12-04b/host_phases.py 4 1024 2>&1 | grep -vE "^W1|Warn" | grep -v probe | tee $OUT/host_phases_c1024.txt
mv $OUT/host_phases.json $OUT/host_phases_c1024.json 2>/dev/null
