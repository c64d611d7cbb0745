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
  python scripts/bench_spec_decode.py --layers 2,4 --batch 16,64,197 --k 0,1,2   # + PROJECTED to 61 layers
  python scripts/bench_spec_decode.py --project l2.json l4.json                  # the projection of two runs
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

from moejax.benchmark.decode_setup import (add_engine_flags, bench_hf_config, engine_settings,  # noqa: E402
                                           fill_without_prefill)
from moejax.config import EngineConfig  # noqa: E402
from moejax.engine.sampling_params import SamplingParams  # noqa: E402
from moejax.models.registry import abstract_params, parse_model_config  # noqa: E402
from moejax.model import random_model  # noqa: E402
from moejax.weights.random_params import random_device_params  # noqa: E402

PROGRAMS = ("decode", "feed", "sample", "spec_verify", "spec_draft", "spec_draft_first")


def expected_tokens(a: float, k: int) -> float:
    """Tokens a speculative step gives a sequence at per-position acceptance rate a: sum_{i=0..k} a^i."""
    return float(sum(a ** i for i in range(k + 1)))


def time_point(hf, params, a, batch: int, k: int, overlap: bool = True) -> dict:
    """Engine decode step times at (batch, k): the batch filled at --input-len, steps that compiled not timed;
    ``overlap``: async scheduling (step N+1 dispatched before step N's tokens are read) or synchronous."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    max_len = a.input_len + a.warmup + a.steps + 2 * (k + 1) + 16
    m = random_model(hf, **engine_settings(a), kernels=a.kernels, params=params, max_model_len=max_len,
                     max_num_seqs=batch, num_kv_blocks=batch * -(-max_len // 16) + batch * (k + 1),
                     async_scheduling=overlap,
                     speculative_config=spec, kv_cache_dtype={"bf16": "auto", "fp8": "fp8"}[a.kv_dtype])
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
    out = {"batch": batch, "k": k, "scheduling": "async" if overlap else "sync", "step_ms": step * 1e3, "measured_tok_per_s": float(np.sum(tokens) / np.sum(times)),
           "projected_tok_per_s": {str(r): batch * expected_tokens(r, k) / step for r in a.acceptance}}
    del m, eng, seqs
    gc.collect()  # the engine's reference cycles hold the KV cache: free it before the next point
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3-ep8-rank")
    ap.add_argument("--layers", default=None,
                    help="decoder layers (first dense), the MTP layer besides; a comma list of two or more counts "
                         "also fits each point's step as fixed + per-layer cost and PROJECTS it to the full depth")
    ap.add_argument("--depth", type=int, default=61, help="layers the projection goes to (DeepSeek-V3: 61)")
    ap.add_argument("--project", nargs="+", default=None, metavar="JSON",
                    help="no timing: fit and project the --json outputs of runs at different layer counts")
    ap.add_argument("--batch", default="1,16,64,256", help="comma list of decode batch sizes")
    ap.add_argument("--k", default="0,1,2", help="comma list of num_speculative_tokens (0: no speculation)")
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--acceptance", default="0.6,0.8,0.9", help="per-position acceptance rates to project")
    ap.add_argument("--scheduling", default="async",
                    help="comma list of async (steps overlapped, the default) and sync: one row each")
    ap.add_argument("--json", default=None)
    add_engine_flags(ap)  # --dtype, --moe-kernel, --mla-kernel, --fp8-fast-accum, ... (moejax/engine_args.py)
    a = ap.parse_args(argv)
    a.acceptance = [float(x) for x in a.acceptance.split(",")]
    if a.project:
        runs = [r for f in a.project for r in (lambda d: d.get("runs", [d]))(json.load(open(f)))]
        print_depth_projection(runs, a.depth, a.acceptance)
        return runs
    batches, ks = [int(x) for x in a.batch.split(",")], [int(x) for x in a.k.split(",")]
    modes = a.scheduling.split(",")
    if not set(modes) <= {"async", "sync"}:
        raise SystemExit(f"--scheduling takes async and/or sync, not {a.scheduling!r}")
    layer_counts = [None] if a.layers is None else [int(x) for x in a.layers.split(",")]
    runs = []
    for layers in layer_counts:
        hf = bench_hf_config(a.preset, layers, num_nextn_predict_layers=1)
        cfg = parse_model_config(hf)
        fp8 = EngineConfig.create(cfg, max_model_len=64).fp8
        params = random_device_params(abstract_params(cfg, a.dtype, fp8))
        print(f"device: {jax.devices()[0].device_kind}; {a.preset} with {cfg.num_hidden_layers} layers + MTP, "
              f"input {a.input_len}, kv {a.kv_dtype}; tokens/s at acceptance {a.acceptance} are PROJECTIONS "
              "(random weights accept nothing): B x sum_{i<=k} a^i / step time")
        rows = []
        for b in batches:
            for k, mode in ((k, m) for k in ks for m in modes):
                r = time_point(hf, params, a, b, k, overlap=mode == "async")
                rows.append(r)
                proj = "  ".join(f"a={x}: {v:9.1f}" for x, v in r["projected_tok_per_s"].items())
                print(f"B={b:4d} k={k} {mode:5s}  step {r['step_ms']:8.3f} ms  measured {r['measured_tok_per_s']:9.1f} tok/s  "
                      f"projected tok/s {proj}", flush=True)
        runs.append({"preset": a.preset, "layers": cfg.num_hidden_layers, "input_len": a.input_len,
                     "kv_dtype": a.kv_dtype, "device": jax.devices()[0].device_kind, "acceptance": a.acceptance,
                     "projection": "tokens/s = batch x sum_{i=0..k} a^i / step time (random weights)",
                     "rows": rows})
        del params
        gc.collect()
    out = runs[0] if len(runs) == 1 else {"runs": runs}
    if len(runs) > 1:
        out["depth_projection"] = print_depth_projection(runs, a.depth, a.acceptance)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return runs


def fit_depth(runs: list[dict]) -> dict:
    """{(batch, k, scheduling): (fixed s, per-layer s)}: a least-squares line through each point's step time against the
    layer count, over runs at two or more layer counts (the MTP layer, lm_head and sampling are fixed)."""
    if len({r["layers"] for r in runs}) < 2:
        raise SystemExit("a depth projection needs runs at two or more layer counts (--layers A,B)")
    pts: dict = {}
    for r in runs:
        for row in r["rows"]:
            pts.setdefault((row["batch"], row["k"], row.get("scheduling", "sync")), []).append((r["layers"], row["step_ms"] * 1e-3))
    out = {}
    for key, xy in pts.items():
        if len({x for x, _ in xy}) < 2:
            continue
        per_layer, fixed = np.polyfit([x for x, _ in xy], [y for _, y in xy], 1)
        out[key] = (float(fixed), float(per_layer))
    return out


def print_depth_projection(runs: list[dict], depth: int, acceptance: list[float]) -> list[dict]:
    """Prints (and returns) the fit's step at ``depth`` layers for each (batch, k), its ratio to k = 0 at
    the same batch, and tokens/s at each acceptance rate against k = 0's: a PROJECTION."""
    fits = fit_depth(runs)
    print(f"\nPROJECTION to {depth} layers (fixed + per-layer cost fitted over layers "
          f"{sorted({r['layers'] for r in runs})}, {runs[0]['device']}): step, ratio to k=0, tok/s vs k=0")
    out = []
    for (b, k, mode), (fixed, per) in sorted(fits.items()):
        step = fixed + per * depth
        plain = fits.get((b, 0, mode))
        ratio = step / (plain[0] + plain[1] * depth) if plain else float("nan")
        gains = {str(x): expected_tokens(x, k) / ratio for x in acceptance}
        out.append({"batch": b, "k": k, "scheduling": mode, "fixed_ms": fixed * 1e3, "per_layer_ms": per * 1e3,
                    "step_ms": step * 1e3, "ratio_to_plain": ratio, "tok_s_vs_plain": gains})
        g = "  ".join(f"a={x}: {v:.2f}x" for x, v in gains.items())
        print(f"B={b:4d} k={k} {mode:5s}  fixed {fixed * 1e3:7.3f} ms + {per * 1e3:6.3f} ms/layer -> {step * 1e3:8.2f} ms  "
              f"x{ratio:5.2f} plain  tok/s {g}")
    return out


if __name__ == "__main__":
    main()
