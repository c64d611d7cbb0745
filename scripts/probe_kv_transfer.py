#!/usr/bin/env python
"""Measures KV-row transfer bandwidth between two processes through jax.experimental.transfer
(moejax/engine/kv_transfer.py), with a DeepSeek-V3-shaped latent cache: 61 layers x 576 values per
token (bf16) or 592-byte FP8 rows (576 values + scale byte + padding), 2048 tokens by default.

  python scripts/probe_kv_transfer.py                       # bf16, CPU or the first GPU
  python scripts/probe_kv_transfer.py --kv-cache-dtype fp8 --tokens 8192 --repeats 10

This process spawns the offering one (the same script, --serve), which offers --repeats copies of the
rows; this one pulls each, waits for it, and prints seconds and GB/s per pull and the median. On one
GPU the two processes share it: give each part of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.4).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from moejax.engine.kv_transfer import KVTransfer  # noqa: E402
from moejax.kernels.kv_quant import FP8, cache_row_dim  # noqa: E402


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--kv-dim", type=int, default=576, help="latent values per token (kv_lora_rank + rope dim)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16 rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one pull may take")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the offering child
    return ap


def shape_dtype(a):
    dt = jnp.dtype(FP8) if a.kv_cache_dtype == "fp8" else jnp.dtype(jnp.bfloat16)
    return (a.layers, a.tokens, cache_row_dim(a.kv_dim, a.kv_cache_dtype)), dt


def serve(a) -> int:
    shape, dt = shape_dtype(a)
    xfer = KVTransfer()
    rows = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dt)
    uuids = [xfer.offer(rows) for _ in range(a.repeats)]
    print(json.dumps({"address": xfer.address, "uuids": uuids}), flush=True)
    sys.stdin.read()  # held until the puller is done
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.serve:
        return serve(a)
    shape, dt = shape_dtype(a)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *(argv or sys.argv[1:])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        xfer = KVTransfer()
        nbytes = 0
        times = []
        for uuid in info["uuids"]:
            t0 = time.perf_counter()
            rows = xfer.pull(info["address"], uuid, shape, dt, a.timeout)
            times.append(time.perf_counter() - t0)
            nbytes = rows.nbytes
            print(f"pull {len(times)}: {times[-1]:.4f} s  {nbytes / times[-1] / 1e9:.2f} GB/s", flush=True)
        med = statistics.median(times)
        print(f"{jax.devices()[0].platform}: {a.layers} layers x {a.tokens} tokens x {shape[-1]} {dt.name} = "
              f"{nbytes / 1e6:.1f} MB; median {med:.4f} s = {nbytes / med / 1e9:.2f} GB/s "
              f"(first pull includes connecting)", flush=True)
    finally:
        child.stdin.close()
        child.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
