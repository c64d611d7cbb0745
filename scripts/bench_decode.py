#!/usr/bin/env python
"""Offline decode benchmark on one device: random weights at a named shape, a full decode
batch at the given concurrency and input length (prefill excluded from the timing), then
timed decode steps. Prints the step time beside the two floors measured in the same run:
bytes one step must read over the measured copy bandwidth, FLOPs over the measured bf16
matmul rate.

  python scripts/bench_decode.py --preset deepseek-v2-lite --layers 6 --concurrency 64 \
      --input-len 1000 --parallel none,dp1-ep1 --json out.json
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.benchmark.roofline import measure_copy_bandwidth, measure_matmul_rate
from moejax.engine.sampling_params import SamplingParams
from moejax.tiny.presets import preset
from moejax.tiny.random_model import random_model


def step_floor(cfg, batch, ctx, itemsize=2, kv_itemsize=2):
    """Bytes and FLOPs of one decode step, from the model's own parameter shapes (any family).

    Bytes: every weight (at these batch sizes every expert is touched) plus the batch's KV
    cache. FLOPs: 2 per active weight per token (routed experts scaled by top-k / E; the
    embedding is a lookup) plus attention, 2 x 2 x heads x cache row per cached token."""
    from moejax.weights.hf_names import flatten, is_stacked_expert
    from moejax.weights.loader import abstract_params
    weights = active = 0
    for path, leaf in flatten(abstract_params(cfg, "bfloat16")).items():
        n = int(np.prod(leaf.shape))
        weights += n
        if is_stacked_expert(path):
            active += n * cfg.num_experts_per_tok // cfg.n_routed_experts
        elif path[0] != "embed_tokens":
            active += n
    L = cfg.num_hidden_layers
    kv = L * batch * ctx * cfg.kv_cache_dim
    flops = 2 * batch * active + 4 * L * batch * ctx * cfg.num_attention_heads * cfg.kv_cache_dim
    return itemsize * weights + kv_itemsize * kv, flops


def run_one(hf, parallel, a):
    m = random_model(hf, a.dtype, parallel=None if parallel == "none" else parallel, kernels=a.kernels,
                     kv_cache_dtype={"bf16": "auto", "fp8": "fp8"}[a.kv_dtype],
                     max_model_len=a.input_len + a.output_len + 16, max_num_seqs=a.concurrency,
                     num_kv_blocks=a.concurrency * (-(-(a.input_len + a.output_len + 16) // 16)))
    eng = m.engine
    rng = np.random.default_rng(0)
    seqs = [eng.add_request(rng.integers(2, m.config.vocab_size, size=a.input_len).tolist(),
                            SamplingParams(max_new_tokens=a.output_len, ignore_eos=True)) for _ in range(a.concurrency)]
    while eng.scheduler.waiting:  # prefill everything (not timed)
        eng.step()
    times = []
    for _ in range(a.warmup + a.steps):
        live = [s for s in seqs if not s.is_finished]
        if len(live) < a.concurrency:
            break
        t = time.perf_counter()
        kind, stepped = eng.step()
        assert kind == "decode"
        times.append(time.perf_counter() - t)
    times = times[a.warmup:]
    del m, eng
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parallel", default="none", help="comma list: none (plain path) and/or configs, e.g. none,dp1-ep1")
    ap.add_argument("--kernels", choices=["auto", "pallas", "xla"], default="xla")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    hf = preset(a.preset)
    if a.layers:
        hf["num_hidden_layers"] = a.layers
    for kv in a.set:
        k, v = kv.split("=", 1)
        hf[k] = json.loads(v)
    from moejax.config import ModelConfig
    cfg = ModelConfig.from_dict(hf)
    bw, rate = measure_copy_bandwidth(), measure_matmul_rate()
    ctx = a.input_len + a.warmup + a.steps // 2
    nbytes, flops = step_floor(cfg, a.concurrency, ctx, kv_itemsize=1 if a.kv_dtype == "fp8" else 2)
    floor = max(nbytes / bw, flops / rate)
    print(f"device: {jax.devices()[0].device_kind}; measured copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    print(f"step floors: memory {nbytes / bw * 1e3:.3f} ms ({nbytes / 1e9:.2f} GB), compute {flops / rate * 1e3:.3f} ms "
          f"({flops / 1e12:.2f} TFLOP)")
    results = {"preset": a.preset, "layers": cfg.num_hidden_layers, "concurrency": a.concurrency,
               "input_len": a.input_len, "device": jax.devices()[0].device_kind, "copy_bw": bw, "matmul_rate": rate,
               "floor_s": floor, "runs": {}}
    base = None
    for p in a.parallel.split(","):
        t = run_one(hf, p, a)
        med = statistics.median(t)
        base = base or med
        r = {"median_step_s": med, "p90_step_s": float(np.percentile(t, 90)), "tok_per_s": a.concurrency / med,
             "floor_fraction": floor / med, "vs_first": med / base, "steps": len(t)}
        results["runs"][p] = r
        print(f"{p:>12}: median step {med * 1e3:.3f} ms, p90 {r['p90_step_s'] * 1e3:.3f} ms, {r['tok_per_s']:.0f} tok/s, "
              f"{r['floor_fraction'] * 100:.1f}% of floor, x{r['vs_first']:.3f} vs {a.parallel.split(',')[0]}")
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
