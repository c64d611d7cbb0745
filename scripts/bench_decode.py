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
    """Bytes and FLOPs of one decode step (all experts assumed touched: true at these batch sizes)."""
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    nh, C, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    q = H * nh * cfg.qk_head_dim if cfg.q_lora_rank is None else H * cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim
    attn_w = q + H * (C + R) + C * nh * (dn + dv) + nh * dv * H
    dense_w = 3 * H * cfg.intermediate_size
    expert_w = 3 * H * cfg.moe_intermediate_size
    shared_w = expert_w * cfg.n_shared_experts
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    weights = L * attn_w + (L - n_moe) * dense_w + n_moe * (cfg.n_routed_experts * expert_w + shared_w) + 2 * cfg.vocab_size * H
    kv = L * batch * ctx * cfg.kv_cache_dim
    bytes_ = itemsize * weights + kv_itemsize * kv
    active = L * attn_w + (L - n_moe) * dense_w + n_moe * (cfg.num_experts_per_tok * expert_w + shared_w) + cfg.vocab_size * H
    flops = 2 * batch * active + 2 * L * batch * ctx * nh * (2 * C + R)  # + absorbed attention
    return bytes_, flops


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
