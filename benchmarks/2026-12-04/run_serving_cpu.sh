#!/bin/bash
# Starts TREE's scripts/serve.py on loopback with SERVE_ARGS, runs this checkout's scripts/bench_serve.py
# against it with BENCH_ARGS (result: $OUT/bench_TAG.json), checks the streams with verify_streams.py
# when VERIFY=1, then stops the server with SIGTERM.
#   run_serving_cpu.sh TREE TAG PORT "SERVE_ARGS" "BENCH_ARGS"
# A tree of an older commit: mkdir /tmp/old && git archive <commit> | tar -x -C /tmp/old
set -u
TREE=$1; TAG=$2; PORT=$3; SARGS=$4; BARGS=$5
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/moejax-serving-cpu}; mkdir -p "$OUT"
echo "== $TAG: $(date -u +%FT%TZ) load: $(cat /proc/loadavg)"
(cd "$TREE" && PYTHONPATH="$TREE" exec python scripts/serve.py --port "$PORT" $SARGS) > "$OUT/serve_$TAG.log" 2>&1 &
SPID=$!
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
grep -m1 Serving "$OUT/serve_$TAG.log"
(cd "$REPO" && PYTHONPATH="$REPO" python scripts/bench_serve.py --port "$PORT" $BARGS --disable-tqdm \
    --result-filename "$OUT/bench_$TAG.json")
if [ "${VERIFY:-0}" = 1 ]; then PYTHONPATH="$REPO" python "$HERE/verify_streams.py" "$OUT/bench_$TAG.json" "$PORT"; fi
kill -TERM $SPID; wait $SPID; echo "server exit $?"
echo "== $TAG done: $(date -u +%FT%TZ) load: $(cat /proc/loadavg)"
