#!/usr/bin/env python
"""Runs scripts/bench_serve.py at several concurrency levels and writes a CSV and a PNG plot of
output throughput against median inter-token latency.

  # the reference sweep, against a running server
  python scripts/sweep.py --base-url http://127.0.0.1:8000 --random-input-len 1024 --random-output-len 1024
  # the tiny random model on CPU: starts scripts/serve.py itself
  python scripts/sweep.py --concurrency 1,4,16 --random-input-len 32 --random-output-len 16 --out-dir /tmp/sweep

Without --base-url it starts the server (scripts/serve.py) on a free loopback port with --model
(default: the embedded tiny random model) and the engine settings' flags (moejax serve's, from
moejax/engine_args.py; --max-num-seqs defaults to the top level), and stops it at the end.

--offline sweeps scripts/bench_decode.py instead (one device, no server, prefill excluded):
for each preset and concurrency, moejax with --kernels auto, the XLA baseline and optionally
the transformers peer; writes decode_sweep.csv and a PNG of throughput against step time.

  python scripts/sweep.py --offline --presets deepseek-v2-lite --concurrency 64,256,512,1024 \
      --random-input-len 2000 --random-output-len 100 --peer
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from moejax.engine_args import EngineArgs  # noqa: E402
from moejax.server.cli import SERVE_DEFAULTS  # noqa: E402

CSV_FIELDS = ["concurrency", "num_prompts", "completed", "failed", "duration", "total_input_tokens",
              "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
              "server_decode_throughput", "server_num_preemptions",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until the server at ``url`` answers /health with 200; RuntimeError if its process exits first or
    ``timeout`` seconds pass."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout:.0f}s")


def start_server(a) -> tuple[subprocess.Popen, str]:
    port = free_port()
    settings = EngineArgs.from_cli_args(a, max_num_seqs=a.max_num_seqs or max(a.levels))
    cmd = [sys.executable, os.path.join(HERE, "serve.py"), "--host", "127.0.0.1", "--port", str(port),
           *settings.to_argv()]
    if a.model:
        cmd += ["--model", a.model]
    cmd += shlex.split(a.server_args or "")
    print("starting:", " ".join(cmd), flush=True)
    log = open(os.path.join(a.out_dir, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, a.server_timeout)
    except Exception:
        proc.terminate()
        raise
    return proc, url


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [r["median_itl_ms"] for r in rows]
    ys = [r["output_throughput"] for r in rows]
    ax.plot(xs, ys, "o-")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("median inter-token latency (ms)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


OFFLINE_FIELDS = ["preset", "layers", "concurrency", "input_len", "tok_per_s", "median_step_ms", "floor_ms",
                  "floor_fraction", "xla_tok_per_s", "peer_tok_per_s", "device", "failed"]


def offline_sweep(a) -> list[dict]:
    """One bench_decode process per (preset, concurrency): moejax with --kernels auto and the XLA
    baseline on the same weights, the transformers peer (child process) up to --peer-max-concurrency.
    Separate processes so that each point starts with the whole GPU free."""
    import json
    rows = []
    for name in a.presets.split(","):
        for c in a.levels:
            out = os.path.join(a.out_dir, f"decode_{name}_c{c}.json")
            cmd = [sys.executable, os.path.join(HERE, "bench_decode.py"), "--preset", name, "--concurrency", str(c),
                   "--input-len", str(a.random_input_len), "--output-len", str(a.random_output_len),
                   "--steps", str(a.steps), "--warmup", str(a.warmup_steps), "--kernels", "auto,xla",
                   "--fill", a.fill, "--json", out]
            if a.layers:
                cmd += ["--layers", str(a.layers)]
            if a.peer and c <= a.peer_max_concurrency:
                cmd += ["--peer"]
            print("+", shlex.join(cmd[1:]), flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"{name} c={c}: bench_decode failed; left out of the table", flush=True)
                continue
            with open(out) as f:
                row = offline_row(json.load(f))
            if row is None:
                print(f"{name} c={c}: moejax (auto) did not run; left out of the table", flush=True)
            else:
                rows.append(row)
    return write_offline(rows, a.out_dir, f"offline decode, input {a.random_input_len}")


def offline_row(r: dict) -> dict | None:
    """One CSV row from a bench_decode --json result (moejax auto vs the XLA baseline, empty if not
    run); None when moejax itself did not run. ``failed`` names the variants that failed, and why."""
    auto = r["runs_by_kernels"].get("auto", {}).get("none")
    if auto is None:
        return None
    xla = r["runs_by_kernels"].get("xla", {}).get("none", {})
    failed = "; ".join(f"{k}: {why}" for k, per in r.get("failed", {}).items() for why in per.values())
    return {"preset": r["preset"], "layers": r["layers"], "concurrency": r["concurrency"], "input_len": r["input_len"],
            "tok_per_s": auto["tok_per_s"], "median_step_ms": auto["median_step_s"] * 1e3,
            "floor_ms": r["floor_s"] * 1e3, "floor_fraction": auto["floor_fraction"],
            "xla_tok_per_s": xla.get("tok_per_s"), "peer_tok_per_s": r.get("peer_tok_per_s"), "device": r["device"],
            "failed": failed}


def collect_offline(paths: list[str], out_dir: str) -> list[dict]:
    """--collect: the CSV and plot from bench_decode JSON files saved earlier (e.g. several runs).
    Per (preset, layers, concurrency, input length) the last file given wins; a point whose run had
    no XLA baseline takes the baseline of an earlier file of the same point (the XLA path is the
    same code), else leaves it empty."""
    import json
    rows = {}
    for p in paths:
        with open(p) as f:
            row = offline_row(json.load(f))
        if row is None:
            print(f"{p}: moejax (auto) did not run; left out")
            continue
        key = (row["preset"], row["layers"], row["concurrency"], row["input_len"])
        for field in ("xla_tok_per_s", "peer_tok_per_s"):
            if row[field] is None and key in rows:
                row[field] = rows[key][field]
        rows[key] = row
    rows = sorted(rows.values(), key=lambda r: (r["preset"], r["layers"], r["concurrency"]))
    return write_offline(rows, out_dir, "offline decode")


def write_offline(rows: list[dict], out_dir: str, title: str) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "decode_sweep.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=OFFLINE_FIELDS)
        w.writeheader()
        w.writerows(rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    for preset, layers in dict.fromkeys((r["preset"], r["layers"]) for r in rows):
        rs = [r for r in rows if (r["preset"], r["layers"]) == (preset, layers)]
        name = f"{preset}, {layers} layers"  # one line per model: a run with fewer layers is another model
        ax.plot([r["median_step_ms"] for r in rs], [r["tok_per_s"] for r in rs], "o-", label=f"{name} (moejax)")
        xs = [r for r in rs if r["xla_tok_per_s"]]
        if xs:
            ax.plot([r["concurrency"] / r["xla_tok_per_s"] * 1e3 for r in xs],
                    [r["xla_tok_per_s"] for r in xs], "x--", label=f"{name} (XLA baseline)")
        for r in rs:
            ax.annotate(f"c={r['concurrency']}", (r["median_step_ms"], r["tok_per_s"]), textcoords="offset points",
                        xytext=(5, 5))
    ax.set_xlabel("decode step time (ms)")
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = os.path.join(out_dir, "decode_sweep.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path} and {png}")
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1024,2048,3072,4096", help="comma-separated max-concurrency levels")
    ap.add_argument("--num-prompts", type=int, default=None, help="per level (default: prompts-multiplier x level)")
    ap.add_argument("--prompts-multiplier", type=float, default=2.0)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=1024)
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="sweep_results")
    ap.add_argument("--base-url", default=None, help="benchmark this server instead of starting one")
    ap.add_argument("--model", default=None, help="checkpoint to serve (default: the embedded tiny random model)")
    ap.add_argument("--server-args", default="", help="extra arguments for scripts/serve.py (its own flags)")
    ap.add_argument("--server-timeout", type=float, default=600)
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--warmup", action="store_true",
                    help="before each level, an unmeasured run of `level` short requests (compiles its shapes)")
    ap.add_argument("--offline", action="store_true", help="sweep scripts/bench_decode.py instead of a server")
    ap.add_argument("--collect", nargs="+", metavar="JSON",
                    help="no runs: the offline CSV and plot from saved bench_decode --json files")
    ap.add_argument("--presets", default="deepseek-v2-lite", help="--offline: comma-separated bench_decode presets")
    ap.add_argument("--layers", type=int, default=None, help="--offline: override the presets' layer count")
    ap.add_argument("--steps", type=int, default=20, help="--offline: timed decode steps per point")
    ap.add_argument("--peer", action="store_true", help="--offline: also run HF transformers")
    ap.add_argument("--peer-max-concurrency", type=int, default=64,
                    help="--offline: the peer only up to this level (its expanded per-head KV cache outgrows the GPU)")
    ap.add_argument("--warmup-steps", type=int, default=3, help="--offline: untimed decode steps per point")
    ap.add_argument("--fill", choices=["prefill", "random"], default="prefill",
                    help="--offline: real prefill, or a random cache of the same length (bench_decode --fill)")
    # The server's engine settings: moejax serve's flags and defaults (--max-num-seqs: the top level).
    EngineArgs.add_cli_args(ap, defaults={**SERVE_DEFAULTS, "max_num_seqs": None})
    a = ap.parse_args(argv)
    a.levels = [int(c) for c in a.concurrency.split(",") if c.strip()]
    os.makedirs(a.out_dir, exist_ok=True)
    if a.collect:
        return collect_offline(a.collect, a.out_dir)
    if a.offline:
        return offline_sweep(a)

    import bench_serve

    proc, url = (None, a.base_url) if a.base_url else start_server(a)
    rows = []
    try:
        for c in a.levels:
            n = a.num_prompts or max(1, int(round(a.prompts_multiplier * c)))
            argv_b = ["--base-url", url, "--num-prompts", str(n), "--max-concurrency", str(c),
                      "--request-rate", a.request_rate, "--dataset-name", "random",
                      "--random-input-len", str(a.random_input_len), "--random-output-len", str(a.random_output_len),
                      "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                      "--seed", str(a.seed), "--result-dir", a.out_dir, "--result-filename", f"bench_c{c}.json"]
            if a.model:
                argv_b += ["--tokenizer", a.model]
            if not a.no_ignore_eos:
                argv_b.append("--ignore-eos")
            if a.disable_tqdm:
                argv_b.append("--disable-tqdm")
            if a.warmup:
                print(f"\n### warm-up at concurrency {c}", flush=True)
                warm = list(argv_b)
                warm[warm.index("--num-prompts") + 1] = str(c)
                warm[warm.index("--random-output-len") + 1] = str(min(4, a.random_output_len))
                warm[warm.index("--result-filename") + 1] = f"warmup_c{c}.json"
                bench_serve.main(warm + ["--seed", str(a.seed + 1)])
            print(f"\n### concurrency {c}: {n} prompts", flush=True)
            m = bench_serve.main(argv_b)
            rows.append({"concurrency": c, "num_prompts": n, **{k: m[k] for k in CSV_FIELDS if k in m}})
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    csv_path = os.path.join(a.out_dir, "sweep.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    png_path = os.path.join(a.out_dir, "sweep.png")
    plot(rows, png_path, f"in={a.random_input_len} out={a.random_output_len} tokens")
    print(f"\nwrote {csv_path} and {png_path}")
    return rows


if __name__ == "__main__":
    main()
