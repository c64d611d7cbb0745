#!/usr/bin/env bash
# Issues 42 and 43 on one GPU: V2-Lite (27 layers, RANDOM weights: --load-format dummy) served at
# --max-num-seqs 1024, FP8 KV. Start-up to /health 200 cold (empty executable and compilation caches) or
# cached (a restart on the kept executables), then the seed workload (2000 in / 100 out, c1024, --ignore-eos)
# with no new feature requested, and (PEN=1) again with penalties on every request.
# Usage (from gpusnap/): [WARM=1] bash benchmarks/2026-12-07g/serve_gpu.sh cold|cached
# WARM=1 (2026-12-07g): a short run first (1024 prompts of 16 tokens, 100 out: every decode bucket, the
# samplers and feeds executed once), to tell a first-execution cost (module loads, graphs) from the rest of
# the first run's 15-20% (2026-12-07d: decode time 30.0 s in a server's first run, 9.7 s in its third).
# XLA_EXTRA: more XLA flags for the server (e.g. --xla_gpu_autotune_level=0: what GEMM autotuning costs the
# cold start, 1,199 s of builds summed in 2026-12-07d, and what it gains the workload).
set -u
PHASE=$1; PEN=${PEN:-1}; WARM=${WARM:-0}
R=/tmp/s; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/s.tgz -C /tmp s; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1 XLA_FLAGS="--xla_disable_hlo_passes=rematerialization ${XLA_EXTRA:-}"
EXE=/tmp/moejax-exe; CC=/tmp/moejax-cc
[ "$PHASE" = cold ] && rm -rf $EXE $CC
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
T0=$(date +%s.%N)
python3 scripts/serve.py --model deepseek-v2-lite --load-format dummy --max-num-seqs 1024 --max-model-len 2176 \
  --kv-cache-dtype fp8 --compilation-cache-dir $CC --executable-cache-dir $EXE --port 8000 > $R/server_$PHASE.log 2>&1 &
SRV=$!
until curl -sf localhost:8000/health >/dev/null; do
  sleep 0.5; kill -0 $SRV 2>/dev/null || { echo "server died"; tail -30 $R/server_$PHASE.log; pack; exit 1; }
done
T1=$(date +%s.%N)
echo "$PHASE start-up to /health 200: $(python3 -c "print(round($T1 - $T0, 1))") s" | tee -a $R/startup.txt
curl -s localhost:8000/metrics | grep -E "^moejax:(startup|xla_programs|compilation_cache|compiles_after|executable)" | tee -a $R/startup.txt
pack
bench() {  # tag, extra args
  local tag=$1; shift
  timeout 240 python3 scripts/bench_serve.py --port 8000 --dataset-name random --random-input-len 2000 \
    --random-output-len 100 --ignore-eos --num-prompts 1024 --max-concurrency 1024 --seed 1 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm "$@" \
    --save-result --result-dir $R --result-filename bench_$tag.json > $R/bench_$tag.txt 2>&1
  grep -E "Benchmark duration|Output token throughput|Median TPOT|Median ITL" $R/bench_$tag.txt | sed "s/^/$tag /"
  curl -s localhost:8000/metrics | grep -E "^moejax:(compiles_after|prefill_time|decode_time)|^vllm:num_preemptions" | sed "s/^/$tag /" | tee $R/metrics_$tag.txt
  pack
}
if [ "$WARM" = 1 ]; then
  timeout 120 python3 scripts/bench_serve.py --port 8000 --dataset-name random --random-input-len 16 \
    --random-output-len 100 --ignore-eos --num-prompts 1024 --max-concurrency 1024 --seed 7 --disable-tqdm \
    > $R/bench_${PHASE}_warm.txt 2>&1
  grep -E "Benchmark duration" $R/bench_${PHASE}_warm.txt | sed "s/^/${PHASE}_warm /"
  curl -s localhost:8000/metrics | grep -E "^moejax:(prefill_time|decode_time)" | sed "s/^/${PHASE}_warm /" | tee $R/metrics_${PHASE}_warm.txt
fi
bench ${PHASE}_plain
[ "$PEN" = 1 ] && bench ${PHASE}_penalties --extra-body '{"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}'
bench ${PHASE}_plain2
kill -TERM $SRV; wait $SRV; pack
