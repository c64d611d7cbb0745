#!/usr/bin/env bash
# Issue 30's scheduling-policy trade-off (not yet run: no device time left this session): the seed workload at
# one concurrency under each policy, one server each (the compilation cache makes the restarts ~2 min).
# Usage: policy_gpu.sh CONCURRENCY   (MAXSEQ as serve_gpu.sh; run serve_gpu.sh cold first to fill the cache)
set -u
C=${1:-256}; MAXSEQ=${MAXSEQ:-512}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
for policy in prefill-first interleave:1 token-budget:4096; do
  tag=$(echo $policy | tr ':' '_')
  python3 scripts/serve.py --model deepseek-v2-lite --load-format dummy --max-num-seqs $MAXSEQ --max-model-len 2176 \
    --async-scheduling --compilation-cache-dir /tmp/moejax-cc-bf16 --scheduling-policy $policy --port 8000 \
    > $OUT/server_$tag.log 2>&1 &
  SRV=$!
  until curl -sf localhost:8000/health >/dev/null; do sleep 1; kill -0 $SRV 2>/dev/null || exit 1; done
  timeout 300 python3 scripts/bench_serve.py --port 8000 --dataset-name random --random-input-len 2000 \
    --random-output-len 100 --ignore-eos --num-prompts $((2 * C)) --max-concurrency $C --seed 1 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm \
    --save-result --result-dir $OUT --result-filename policy_$tag.json > $OUT/policy_$tag.txt 2>&1
  grep -E "Benchmark duration|Output token throughput|Median TTFT|Median TPOT|Median ITL|P99 ITL" $OUT/policy_$tag.txt | sed "s/^/$policy /"
  kill -TERM $SRV; wait $SRV
done
