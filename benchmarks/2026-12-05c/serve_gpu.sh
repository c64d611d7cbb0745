#!/usr/bin/env bash
# Issue 30 on one GPU: the seed workload (input 2000, output 100, --ignore-eos) through scripts/serve.py
# (DeepSeek-V2-Lite, 27 layers, RANDOM weights made on the device: --load-format dummy) and bench_serve.py.
# Usage: serve_gpu.sh PHASE WEIGHTS CONCURRENCIES...   PHASE: cold (empty compilation cache) | warm
# Env: MAXSEQ (1024), KV (auto|fp8), REPS (2: a fresh server, then the same server again).
# The compilation cache lives in the repository's ignored .gpu-cache/ so a next call on the same warm
# machine (policy_gpu.sh) finds it.
set -u
PHASE=$1; W=$2; shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
MAXSEQ=${MAXSEQ:-1024}; KV=${KV:-auto}; REPS=${REPS:-2}
CC=$PWD/.gpu-cache/$W-$MAXSEQ-$KV
[ "$PHASE" = cold ] && rm -rf $CC
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu_$PHASE.txt
T0=$(date +%s.%N)
python3 scripts/serve.py --model deepseek-v2-lite --load-format dummy --weight-dtype $W --max-num-seqs $MAXSEQ \
  --max-model-len 2176 --kv-cache-dtype $KV --async-scheduling --compilation-cache-dir $CC --port 8000 \
  > $OUT/server_${PHASE}_$W.log 2>&1 &
SRV=$!
until curl -sf localhost:8000/health >/dev/null; do
  sleep 1; kill -0 $SRV 2>/dev/null || { echo "server died"; tail -30 $OUT/server_${PHASE}_$W.log; exit 1; }
done
T1=$(date +%s.%N)
echo "$PHASE start-up to /health 200: $(python3 -c "print(round($T1 - $T0, 1))") s" | tee -a $OUT/startup_$W.txt
curl -s localhost:8000/metrics | grep -E "^moejax:(startup|xla_programs|compilation_cache|compiles_after)|^vllm:kv_cache" | tee -a $OUT/startup_$W.txt
grep -E "KV cache|num_kv_blocks|blocks" $OUT/server_${PHASE}_$W.log | head -3
for c in "$@"; do
  for rep in $(seq 1 $REPS); do
    tag=${PHASE}_${W}_c${c}_r$rep
    timeout 300 python3 scripts/bench_serve.py --port 8000 --dataset-name random --random-input-len 2000 \
      --random-output-len 100 --ignore-eos --num-prompts $c --max-concurrency $c --seed $rep$c \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm \
      --save-result --result-dir $OUT --result-filename bench_$tag.json > $OUT/bench_$tag.txt 2>&1
    grep -E "Benchmark duration|Output token throughput|decode-only|Median TPOT|Median ITL|P90 ITL" $OUT/bench_$tag.txt | sed "s/^/$tag /"
    curl -s localhost:8000/metrics | grep -E "^moejax:(compiles_after|prefill_time|decode_time|prefill_tokens|decode_tokens|decode_steps)|^vllm:num_preemptions" | sed "s/^/$tag /" | tee $OUT/metrics_$tag.txt
  done
done
kill -TERM $SRV; T2=$(date +%s.%N); wait $SRV; echo "exit after SIGTERM: $(python3 -c "print(round($(date +%s.%N) - $T2, 1))") s"
