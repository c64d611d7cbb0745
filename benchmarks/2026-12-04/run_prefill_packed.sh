#!/usr/bin/env bash
# (Its prefill_{v2lite,step3}.{txt,json} are kept as prefill_*_run3.*.)
# Issue 17: (1) packed (varlen) prefill vs the padded layout on mixed prompt lengths (flash kernel on the
# packed stream, its first GPU run), (2) the table's remaining points (V2-Lite 1x8k / 32x2k / 1x32k,
# Step3 32x2k / 1x32k), flash path.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
MIX=2000,30,500,1200,64,17,900,300
timeout 260 python3 scripts/bench_prefill.py --preset deepseek-v2-lite --mixed $MIX --points 1x8192,32x2048,1x32768 \
  --kernels auto --iters 3 --json $R/prefill_v2lite.json > $R/prefill_v2lite.txt 2>&1; echo "rc=$?" >> $R/prefill_v2lite.txt
grep -vE "^W1|Warn" $R/prefill_v2lite.txt | tail -12 | cut -c1-260
timeout 240 python3 scripts/bench_prefill.py --preset step3-ep8-rank --mixed $MIX --points 32x2048,1x32768 \
  --kernels auto --iters 3 --json $R/prefill_step3.json > $R/prefill_step3.txt 2>&1; echo "rc=$?" >> $R/prefill_step3.txt
grep -vE "^W1|Warn" $R/prefill_step3.txt | tail -10 | cut -c1-260
cd /tmp && tar czf $OUT/run3.tgz res
