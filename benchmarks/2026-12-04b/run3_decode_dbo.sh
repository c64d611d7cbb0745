#!/usr/bin/env bash
# Issue 18: V2-Lite (27 layers) decode at c256/c1024, input 2000, Pallas selection (auto) and XLA, bf16;
# host overhead at c1024, synchronous and overlapped loops (after the sampler fix).
# Issue 21: dp8-ep8 decode step under the mock GPU topology (shard autotuning off); if it fails, the
# split's cost on one device (V3 EP8-rank shape, dp1-ep1, DBO forced on vs off).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 110 python3 scripts/dbo_schedule.py --mock-topology 1x8x1 --preset deepseek-v3 --layers 3 --batch 64,256 \
  --ctx 2000 --steps 10 --watchdog 95 --dump /tmp/dump --json $OUT/dbo_mock.json > $OUT/dbo_mock.txt 2>&1
rc=$?; echo "rc=$rc" >> $OUT/dbo_mock.txt; grep -vE "^W1|Warn|^  File" $OUT/dbo_mock.txt | head -40
if [ $rc -ne 0 ]; then
timeout 100 python3 scripts/dbo_schedule.py --ranks 1 --preset deepseek-v3-ep8-rank --layers 4 --batch 64,256 \
  --ctx 2000 --steps 10 --watchdog 95 --json $OUT/dbo_single.json 2>&1 | grep -vE "^W1|Warn" | tee $OUT/dbo_single.txt
fi
(cd /tmp && tar czf $OUT/dbo_dump.tgz dump 2>/dev/null)
timeout 240 python3 scripts/bench_decode.py --preset deepseek-v2-lite --kernels auto,xla --fill random --steps 6 --warmup 2 \
  --weight-dtype bf16 --concurrency 256,1024 --input-len 2000 --output-len 16 --json $OUT/decode_v2lite.json \
  > $OUT/decode_v2lite.txt 2>&1; echo "rc=$?" >> $OUT/decode_v2lite.txt
grep -E "===|floors|median|failed|rc=|Error" $OUT/decode_v2lite.txt | cut -c1-220
timeout 170 python3 scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 1024 --input-len 2000 \
  --output-len 28 --steps 8 --warmup 2 --fill random --kernels auto --host-overhead --json $OUT/host_overhead.json \
  2>&1 | grep -vE "^W1|Warn" | tee $OUT/host_overhead.txt; echo "rc=${PIPESTATUS[0]}" | tee -a $OUT/host_overhead.txt
