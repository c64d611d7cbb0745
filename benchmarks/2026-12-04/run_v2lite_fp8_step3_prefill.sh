#!/usr/bin/env bash
# (Its prefill_step3.{txt,json} are kept as prefill_step3_run1.*: run_prefill_packed.sh wrote the same names.)
# (1) Issue 16: FP8 (W8A16, [E, out, in] experts) vs bf16 whole decode steps, DeepSeek-V2-Lite (27 layers),
#     c64 / c256 / c1024, input 2000, both formats in one process.
# (2) Issue 17: prefill of step3-ep8-rank (16 layers): flash (auto) vs the full-score path.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/device.txt
timeout 330 python3 scripts/bench_decode.py --preset deepseek-v2-lite --kernels auto --fill random --steps 6 --warmup 2 \
  --weight-dtype fp8,bf16 --concurrency 64,256,1024 --input-len 2000 --output-len 16 --json $R/decode_v2lite.json \
  > $R/decode_v2lite.txt 2>&1; echo "rc=$?" >> $R/decode_v2lite.txt
grep -E "===|floors|median|failed|rc=|Error" $R/decode_v2lite.txt | cut -c1-220
timeout 230 python3 scripts/bench_prefill.py --preset step3-ep8-rank --points 1x2048,8x2048,1x8192 --kernels auto,full \
  --iters 3 --json $R/prefill_step3.json > $R/prefill_step3.txt 2>&1; echo "rc=$?" >> $R/prefill_step3.txt
tail -25 $R/prefill_step3.txt | cut -c1-240
cd /tmp && tar czf $OUT/run1.tgz res
