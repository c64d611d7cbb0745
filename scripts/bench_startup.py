#!/usr/bin/env python
"""Start-up time of the server (after ``vllm bench startup``): seconds from launch to /health 200.

Starts ``moejax serve`` (default: the embedded tiny random model) as a subprocess, polls /health, and
reads the server's own log to split the time into loading (process start, imports, weights: up to the
first program), tracing + lowering (the gaps between program builds) and XLA building (the sum of the
per-program build times the runner logs, and ``build_busy_s``, the seconds some build ran: builds overlap
where several compile workers run). ``--runs`` starts it that many times in a row: the first run
is "cold" unless the caches already hold its programs, the next ones "cached" (the persistent caches
of moejax/compilation.py and moejax/executable_cache.py, in ``--cache-dir``, a fresh temporary folder
by default so the first run is cold).

    python scripts/bench_startup.py                     # the tiny default: cold, then cached
    python scripts/bench_startup.py --runs 1 -- --max-num-seqs 8    # flags after -- go to the server
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The runner's line a program (moejax/engine/model_runner.py): "compiled LABEL in S s (i/n)", "loaded ..." when
# it came from the executable cache.
# precompile's line for the executable cache (moejax/engine/precompile.py): its hits, misses and why rebuilt.
CACHE_LINE = re.compile(r"moejax\.precompile: (executable cache .*)")
PROGRAM_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) moejax\.precompile: (compiled|loaded) (.+?) in ([0-9.]+) s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def parse_log(lines: list[str], t_start_wall: float) -> dict:
    """Shares of the start-up from the server's per-program log lines (their timestamps, milliseconds)."""
    import datetime
    stamps, built, loaded = [], 0.0, 0.0
    n_built = n_loaded = 0
    for line in lines:
        m = PROGRAM_LINE.search(line)  # tqdm's bar may share the line
        if not m:
            continue
        ts = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        stamps.append((ts, float(m.group(4))))
        if m.group(2) == "compiled":
            built += float(m.group(4))
            n_built += 1
        else:
            loaded += float(m.group(4))
            n_loaded += 1
    if not stamps:
        return {"programs_compiled": 0, "programs_loaded": 0}
    first_begin = min(ts - d for ts, d in stamps)
    span = max(ts for ts, _ in stamps) - first_begin
    # Builds and loads overlap where several workers run them (moejax/engine/precompile.py): the sums are work,
    # their union the span's busy seconds; the rest of the span is tracing and lowering alone.
    busy, end = 0.0, first_begin
    for b, e in sorted((ts - d, ts) for ts, d in stamps):
        busy += max(0.0, e - max(b, end))
        end = max(end, e)
    return {"programs_compiled": n_built, "programs_loaded": n_loaded,
            "load_s": round(first_begin - t_start_wall, 2),  # imports, weights, cache set-up
            "xla_compile_s": round(built, 2), "executable_load_s": round(loaded, 2),  # summed over workers
            "build_busy_s": round(busy, 2),  # seconds some build or load ran
            "trace_lower_s": round(span - busy, 2)}  # the rest of the precompile span


def one_run(server_args: list[str], cache_dir: str, timeout: float, keep_log: str | None = None) -> dict:
    port = free_port()
    env = dict(os.environ, MOEJAX_COMPILATION_CACHE_DIR=os.path.join(cache_dir, "jax"),
               MOEJAX_EXECUTABLE_CACHE_DIR=os.path.join(cache_dir, "executables"))
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--port", str(port), *server_args]
    log = tempfile.TemporaryFile("w+")
    load_before = os.getloadavg()[0]
    t0_wall, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/health"
    try:
        while not healthy(url):
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"the server exited ({proc.returncode}) before /health answered:\n{log.read()[-4000:]}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"/health did not answer 200 within {timeout:g} s")
            time.sleep(0.1)
        total = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.seek(0)
    text = log.read()
    if keep_log:
        with open(keep_log, "w") as f:
            f.write(text)
    lines = text.split("\n")  # not splitlines: the bar's carriage returns would cut a line
    cache = [m.group(1) for ln in lines if (m := CACHE_LINE.search(ln))]
    # How loaded the machine was (1-minute load average before and after): a 2-core machine shared with
    # other work starts slower.
    return {"to_health_s": round(total, 2), **parse_log(lines, t0_wall), "cache": cache[-1] if cache else None,
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="starts in a row (1: cold only)")
    ap.add_argument("--cache-dir", help="where the caches live (default: a fresh temporary folder: a cold first run)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--log-dir", help="keep each run's server log here (run0.log, run1.log, ...)")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: flags for moejax serve")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    server_args = a.server_args[1:] if a.server_args[:1] == ["--"] else a.server_args
    cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="moejax-bench-startup-")
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    results = []
    for i in range(a.runs):
        r = {"run": i, "kind": "cold" if i == 0 and not a.cache_dir else "cached" if i else "as found", **one_run(
            server_args, cache_dir, a.timeout, a.log_dir and os.path.join(a.log_dir, f"run{i}.log"))}
        results.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"server_args": server_args, "cpu_count": os.cpu_count(), "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
