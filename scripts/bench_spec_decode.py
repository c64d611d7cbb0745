#!/usr/bin/env python
"""Speculative decoding (MTP, issue 32) step time on one device: random weights at a named shape with its
MTP layer (num_nextn_predict_layers 1), a full decode batch of --input-len tokens (cache filled without a
prefill: --fill random, as bench_decode.py), then timed engine decode steps with k = 0 (no speculation),
1, 2 ... draft tokens. A speculative step is the verify (the target over B x (k+1) rows), the sampler and
the MTP draft program.

Random weights accept (almost) no draft, so tokens/s is also PROJECTED at per-position acceptance
rates a (--acceptance): a step gives a sequence sum_{i=0..k} a^i tokens on average (the drafts accepted
in a row, plus one), so projected tokens/s = B x that / step time. k = 0 gives B tokens a step.

  python scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --layers 4 --batch 1,16,64,256 \\
      --k 0,1,2 --input-len 1000 --json spec.json
  python scripts/bench_spec_decode.py --preset v3-tiny --batch 1,2 --k 0,1 --input-len 8 --steps 2   # CPU smoke
"""

import argparse
import gc
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax.benchmark.decode_setup import bench_hf_config, fill_without_prefill  # noqa: E402
from moejax.config import EngineConfig  # noqa: E402
from moejax.engine.sampling_params import SamplingParams  # noqa: E402
from moejax.models.registry import parse_model_config  # noqa: E402
from moejax.tiny.random_model import random_model  # noqa: E402
from moejax.weights.random_params import random_device_params  # noqa: E402

PROGRAMS = ("decode", "feed", "sample", "spec_verify", "spec_draft", "spec_draft_first")


def expected_tokens(a: float, k: int) -> float:
    """Tokens a speculative step gives a sequence at per-position acceptance rate a: sum_{i=0..k} a^i."""
    return float(sum(a ** i for i in range(k + 1)))


def time_point(hf, params, a, batch: int, k: int) -> dict:
    """Engine decode step times at (batch, k): the batch filled at --input-len, steps that compiled not timed."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    max_len = a.input_len + a.warmup + a.steps + 2 * (k + 1) + 16
    m = random_model(hf, a.dtype, kernels=a.kernels, params=params, max_model_len=max_len, max_num_seqs=batch,
                     num_kv_blocks=batch * -(-max_len // 16) + batch * (k + 1), speculative_config=spec,
                     kv_cache_dtype={"bf16": "auto", "fp8": "fp8"}[a.kv_dtype])
    eng = m.engine
    rng = np.random.default_rng(0)
    seqs = [eng.add_request(rng.integers(2, m.config.model.vocab_size, size=a.input_len).tolist(),
                            SamplingParams(max_new_tokens=max_len - a.input_len - 1, ignore_eos=True))
            for _ in range(batch)]
    fill_without_prefill(eng)
    times, tokens = [], []
    while len(times) < a.warmup + a.steps:
        before = sum(eng.runner.trace_counts[p] for p in PROGRAMS)
        n0 = sum(s.num_output_tokens for s in seqs)
        t = time.perf_counter()
        kind, _ = eng.step()
        dt = time.perf_counter() - t
        assert kind == "decode" and not any(s.is_finished for s in seqs)
        if sum(eng.runner.trace_counts[p] for p in PROGRAMS) == before:  # compiled in this step: not timed
            times.append(dt)
            tokens.append(sum(s.num_output_tokens for s in seqs) - n0)
    times, tokens = times[a.warmup:], tokens[a.warmup:]
    step = float(np.median(times))
    out = {"batch": batch, "k": k, "step_ms": step * 1e3, "measured_tok_per_s": float(np.sum(tokens) / np.sum(times)),
           "projected_tok_per_s": {str(r): batch * expected_tokens(r, k) / step for r in a.acceptance}}
    del m, eng, seqs
    gc.collect()  # the engine's reference cycles hold the KV cache: free it before the next point
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3-ep8-rank")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (first dense), the MTP layer besides")
    ap.add_argument("--batch", default="1,16,64,256", help="comma list of decode batch sizes")
    ap.add_argument("--k", default="0,1,2", help="comma list of num_speculative_tokens (0: no speculation)")
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--acceptance", default="0.6,0.8,0.9", help="per-position acceptance rates to project")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.acceptance = [float(x) for x in a.acceptance.split(",")]
    batches, ks = [int(x) for x in a.batch.split(",")], [int(x) for x in a.k.split(",")]
    hf = bench_hf_config(a.preset, a.layers, num_nextn_predict_layers=1)
    cfg = parse_model_config(hf)
    params = random_device_params(cfg, a.dtype, fp8=EngineConfig.create(cfg, max_model_len=64).fp8)
    print(f"device: {jax.devices()[0].device_kind}; {a.preset} with {cfg.num_hidden_layers} layers + MTP, "
          f"input {a.input_len}, kv {a.kv_dtype}; tokens/s at acceptance {a.acceptance} are PROJECTIONS "
          "(random weights accept nothing): B x sum_{i<=k} a^i / step time")
    rows = []
    for b in batches:
        for k in ks:
            r = time_point(hf, params, a, b, k)
            rows.append(r)
            proj = "  ".join(f"a={x}: {v:9.1f}" for x, v in r["projected_tok_per_s"].items())
            print(f"B={b:4d} k={k}  step {r['step_ms']:8.3f} ms  measured {r['measured_tok_per_s']:9.1f} tok/s  "
                  f"projected tok/s {proj}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "layers": cfg.num_hidden_layers, "input_len": a.input_len,
                       "kv_dtype": a.kv_dtype, "device": jax.devices()[0].device_kind, "acceptance": a.acceptance,
                       "projection": "tokens/s = batch x sum_{i=0..k} a^i / step time (random weights)",
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
