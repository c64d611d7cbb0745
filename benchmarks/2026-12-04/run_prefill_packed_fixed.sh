#!/usr/bin/env bash
# Issue 17: run3's packed-vs-padded comparison again: run3's padded layout left its padding slot inside the
# cache (so padding counted as real tokens: routed to experts, thousands of writes to one row); fixed.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
timeout 390 python3 scripts/bench_prefill.py --preset deepseek-v2-lite,step3-ep8-rank --mixed 2000,30,500,1200,64,17,900,300 \
  --points "" --kernels auto --iters 3 --json $R/prefill_mixed.json > $R/prefill_mixed.txt 2>&1; echo "rc=$?" >> $R/prefill_mixed.txt
grep -vE "^W1|Warn" $R/prefill_mixed.txt | tail -8 | cut -c1-260
cd /tmp && tar czf $OUT/run4.tgz res
