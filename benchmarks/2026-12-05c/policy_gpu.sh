#!/usr/bin/env bash
# Issue 30's scheduling-policy trade-off: the seed workload shape (input 2000, output 100) with 2C prompts
# at concurrency C (requests arrive as others finish, so prefills meet running streams), one server per
# policy, started from the compilation cache serve_gpu.sh cold filled (same MAXSEQ/KV: same programs).
# Usage: policy_gpu.sh C POLICIES...
set -u
C=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
MAXSEQ=${MAXSEQ:-1024}; KV=${KV:-auto}; W=${W:-bf16}
CC=$PWD/.gpu-cache/$W-$MAXSEQ-$KV
ls $CC | wc -l | sed 's/^/cache entries: /'
for policy in "$@"; do
  tag=$(echo $policy | tr ':' '_')
  T0=$(date +%s.%N)
  python3 scripts/serve.py --model deepseek-v2-lite --load-format dummy --weight-dtype $W --max-num-seqs $MAXSEQ \
    --max-model-len 2176 --kv-cache-dtype $KV --async-scheduling --compilation-cache-dir $CC \
    --scheduling-policy $policy --port 8000 > $OUT/server_$tag.log 2>&1 &
  SRV=$!
  until curl -sf localhost:8000/health >/dev/null; do sleep 1; kill -0 $SRV 2>/dev/null || { tail -20 $OUT/server_$tag.log; exit 1; }; done
  echo "$policy start-up $(python3 -c "print(round($(date +%s.%N) - $T0, 1))") s"
  timeout 300 python3 scripts/bench_serve.py --port 8000 --dataset-name random --random-input-len 2000 \
    --random-output-len 100 --ignore-eos --num-prompts $((2 * C)) --max-concurrency $C --seed 7 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm \
    --save-result --result-dir $OUT --result-filename policy_$tag.json > $OUT/policy_$tag.txt 2>&1
  grep -E "Benchmark duration|Output token throughput|decode-only|Median TTFT|P99 TTFT|Median TPOT|Median ITL|P99 ITL" $OUT/policy_$tag.txt | sed "s/^/$policy /"
  curl -s localhost:8000/metrics | grep -E "^moejax:compiles_after" | sed "s/^/$policy /"
  kill -TERM $SRV; wait $SRV
done
