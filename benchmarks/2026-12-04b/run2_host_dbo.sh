#!/usr/bin/env bash
# Issue 18 after the sampler fix (no lax.cond in the step): host-loop phases, V2-Lite 4 layers, c256 and c1024.
# Issue 21: dp8-ep8 decode step under the mock GPU topology, with a watchdog (run 1 timed out silently).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 130 python3 scripts/dbo_schedule.py --mock-topology 1x8x1 --preset deepseek-v3 --layers 3 --batch 64,256 \
  --ctx 2000 --steps 10 --watchdog 100 --dump /tmp/dump --json $OUT/dbo_mock.json > $OUT/dbo_mock.txt 2>&1
echo "rc=$?" >> $OUT/dbo_mock.txt; grep -vE "^W1|Warn" $OUT/dbo_mock.txt | head -60
(cd /tmp && tar czf $OUT/dbo_dump.tgz dump 2>/dev/null)
for c in 256 1024; do
timeout 160 python3 benchmarks/2026-12-04b/host_phases.py 4 $c 2>&1 | grep -vE "^W1|Warn" | tee $OUT/host_phases_c$c.txt
mv $OUT/host_phases.json $OUT/host_phases_c$c.json 2>/dev/null
done
