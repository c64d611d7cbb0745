#!/usr/bin/env python
"""Colocated against disaggregated serving at the same load: TTFT, ITL and TPOT distributions.

Starts `scripts/serve.py` colocated, runs `scripts/bench_serve.py` against it (vLLM's `bench serve`
definitions), stops it; then `scripts/serve.py --disaggregated` (1 prefill + 1 decode worker unless
told otherwise) with the same load; prints p50/p90/p99 of each and writes both results as JSON.

  # CPU: the embedded tiny random model, a short load (checks the pipeline; times mean nothing)
  JAX_PLATFORMS=cpu python scripts/bench_disaggregated.py --num-prompts 32 --request-rate 8 \\
      --random-input-len 64 --random-output-len 16

  # one GPU shared by the two workers: each worker takes part of its memory
  python scripts/bench_disaggregated.py --model CKPT --mem-fraction 0.85 --worker-mem-fraction 0.4 \\
      --num-prompts 200 --request-rate 4 --random-input-len 2000 --random-output-len 200 --random-range-ratio 0.5

Mixed load: `--random-range-ratio` draws input and output lengths from [len * (1 - r), len * (1 + r)],
and `--request-rate` sends requests as a Poisson process, so prefills arrive while others decode.
Every option after `--` goes to every server (e.g. `-- --kv-cache-dtype fp8 --max-num-seqs 64`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from sweep import free_port, wait_healthy  # noqa: E402  (scripts/sweep.py: the same server handling)

METRICS = ("ttft", "itl", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server drains, a disaggregated one stops its workers
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_mode(mode: str, a, server_args: list[str], out_dir: str) -> dict:
    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "scripts/serve.py"), "--port", str(port)]
    if a.model:
        cmd += ["--model", a.model]
    env = dict(os.environ)
    if mode == "disaggregated":
        cmd += ["--disaggregated", "--prefill-workers", str(a.prefill_workers),
                "--decode-workers", str(a.decode_workers)]
        if a.worker_mem_fraction:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(a.worker_mem_fraction)  # each worker's share
    elif a.mem_fraction:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(a.mem_fraction)
    log = open(os.path.join(out_dir, f"server_{mode}.log"), "w")
    print(f"[{mode}] {' '.join(cmd + server_args)}", flush=True)
    proc = subprocess.Popen(cmd + server_args, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, a.start_timeout)
        result = os.path.join(out_dir, f"bench_{mode}.json")
        bench = [sys.executable, os.path.join(ROOT, "scripts/bench_serve.py"), "--base-url", url,
                 "--num-prompts", str(a.num_prompts), "--request-rate", str(a.request_rate),
                 "--random-input-len", str(a.random_input_len), "--random-output-len", str(a.random_output_len),
                 "--random-range-ratio", str(a.random_range_ratio), "--ignore-eos", "--seed", str(a.seed),
                 "--percentile-metrics", ",".join(METRICS), "--metric-percentiles",
                 ",".join(map(str, PERCENTILES)), "--result-filename", result, "--disable-tqdm"]
        if a.max_concurrency:
            bench += ["--max-concurrency", str(a.max_concurrency)]
        subprocess.run(bench, check=True)
        with open(result) as f:
            m = json.load(f)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        # the transfer totals (the histogram's count and sum, bytes, failures), label sets dropped
        wanted = ("moejax:kv_transfer_seconds_count", "moejax:kv_transfer_seconds_sum",
                  "moejax:kv_transfer_bytes_total", "moejax:kv_transfer_failures_total")
        m["server_metrics"] = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in text.splitlines()
                               if line.split("{")[0].split(" ")[0] in wanted}
        return m
    finally:
        stop(proc)
        log.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: serve.py's embedded tiny random model)")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--mem-fraction", type=float, default=None, help="the colocated server's GPU memory share")
    ap.add_argument("--worker-mem-fraction", type=float, default=None,
                    help="each disaggregated worker's GPU memory share (workers sharing one GPU)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=8.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--random-range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="colocated,disaggregated")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out-dir", default=".")
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    modes = a.modes.split(",")
    if not set(modes) <= {"colocated", "disaggregated"}:
        raise SystemExit(f"--modes: {a.modes!r}: colocated and/or disaggregated")
    os.makedirs(a.out_dir, exist_ok=True)
    results = {mode: run_mode(mode, a, server_args, a.out_dir) for mode in modes}
    print(f"\n{'metric (ms)':<14}" + "".join(f"{m:>16}" for m in modes))
    for key in METRICS:
        for p in PERCENTILES:
            name = f"p{p}_{key}_ms"
            print(f"{name:<14}" + "".join(f"{results[m][name]:>16.2f}" for m in modes))
    for m in modes:
        print(f"{m}: {results[m]['completed']} completed, output {results[m]['output_throughput']:.1f} tok/s"
              + "".join(f", {k.split(':')[1]} {v:g}" for k, v in results[m]["server_metrics"].items()))
    with open(os.path.join(a.out_dir, "bench_disaggregated.json"), "w") as f:
        json.dump({"args": vars(a), "server_args": server_args, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
