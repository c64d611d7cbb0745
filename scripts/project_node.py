#!/usr/bin/env python
"""A MODEL, not a measurement: 8-GPU node decode throughput for DeepSeek-V3 and Step3 projected from
one GPU's measured per-rank decode step, the dispatch/combine bytes per MoE layer and a stated
interconnect bandwidth, with and without dual-batch overlap (DBO). Real multi-GPU runs replace it.

  python scripts/project_node.py                       # both models, 8x H200 and 8x MI300X (192 GB)
  python scripts/project_node.py --model v3 --link h200 --concurrency 1024,1576 --efficiency 0.6 --json out.json

Only what fits is projected: each node's concurrency is checked against the memory plan
(scripts/plan_memory.py) first; by default the seed's concurrency where the node holds it (8x MI300X:
4096), else the largest that fits (8x H200: 1,576 for DeepSeek-V3 at input 2000 / output 100).

Per step of a node at concurrency C (T = C / 8 tokens per rank, every sequence one token):
- compute: the EP8-rank preset's decode step measured on one GPU (MEASURED below, BENCHMARKS.md;
  interpolated linearly in T between measured points), times full layers / preset layers;
- exchange: per MoE layer, dispatch and combine, each rank sending to each other rank the tokens
  routed there: with the ``a2a`` backend today the whole static buffer [ranks, T, H] (worst case,
  nothing dropped); with a backend moving only the rows that exist (``ragged``, MoRI) the expected
  number of remote ranks a token reaches; FP8 dispatch (MoRI Fp8DirectCast, DeepEP) halves the
  dispatch bytes; bytes / (link bandwidth per direction x efficiency) + a latency per collective;
- without DBO: compute + exchange; with DBO: max(compute x (1 + DBO cost), exchange) + latency, the
  cost of the split measured under the mock topology (docs/dbo.md); this bound assumes the exchange
  is hidden entirely, which the compiled schedule shows only for the experts' part (docs/dbo.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax.benchmark.memory_plan import plan  # noqa: E402
from moejax.tiny.presets import preset  # noqa: E402

# `scripts/bench_decode.py --preset <p> --kernels auto --fill random` (BENCHMARKS.md), one GPU: tokens per
# rank -> (step seconds, preset layers, source). DeepSeek-V3 with FP8 weights (bf16 does not fit
# 8 x 141 GB: 671e9 x 2 B / 8 = 168 GB a GPU). Since 2026-12-06c the points at 128-512 tokens a rank and
# Step3's at 32 are from one H100 80GB (3.35 TB/s HBM3: pessimistic for an H200's 4.8 TB/s at these
# memory-bound or mixed points); the others from one H200. The engine's async loop, context 2048 (V3) /
# 4096 (Step3); scaling a few layers' step to 61 also scales lm_head and sampling (pessimistic by up to
# ~1 ms x 61 / layers).
MEASURED = {
    "v3": {"preset": "deepseek-v3-ep8-rank (FP8 weights)", "full_layers": 61, "moe_layers": 58, "hidden": 7168,
           "points": {128: (12.421e-3, 8, "H100 2026-12-06c FP8 c128, 8 layers"),
                      256: (14.221e-3, 8, "H100 2026-12-06c FP8 c256, 8 layers"),
                      512: (24.190e-3, 8, "H100 2026-12-06c FP8 c512, 8 layers"),
                      1024: (114.27e-3, 12, "H200 2026-12-04 FP8 c1024, 12 layers, sync loop")},
           # 256 experts top-8 in 8 groups, at most 4 groups a token (DeepSeek's node-limited routing);
           # with 32 experts a rank each group is one rank: a token reaches at most 4 ranks
           "experts": 256, "top_k": 8, "max_ranks_per_token": 4,
           "targets": "21,224 tok/s per 8x MI300X (SGLang, input 2000, output 100, concurrency 4096); "
                      "22,282 per 8x H100"},
    "step3": {"preset": "step3-ep8-rank (FP8 weights at 32 tokens a rank, bf16 above)", "full_layers": 61,
              "moe_layers": 56, "hidden": 7168,
              "points": {32: (3.487e-3, 4, "H100 2026-12-06c FP8 c32, 4 layers"),
                         64: (16.34e-3, 16, "H200 2026-12-03c c64"),
                         256: (34.03e-3, 16, "H200 2026-12-03 c256"), 512: (52.27e-3, 16, "H200 2026-12-03b c512"),
                         1024: (70.81e-3, 12, "H200 2026-12-03c c1024, 12 layers")},
              "experts": 48, "top_k": 3, "max_ranks_per_token": 3,
              "targets": "4,082 decode tok/s on 8x MI308X (input 4096, output 256, concurrency 256)"},
}
# Per-direction interconnect bandwidth a GPU, from the vendors' datasheets.
LINKS = {
    "h200": (450e9, "H200 NVLink 4: 900 GB/s bidirectional a GPU (NVIDIA H200 datasheet)"),
    "mi300x": (448e9, "MI300X Infinity Fabric: 896 GB/s peak aggregate bidirectional a GPU, 7 links (AMD datasheet)"),
}
# Each node's GPU memory (GB a GPU, datasheets): a concurrency is projected only where the memory plan
# (moejax/benchmark/memory_plan.py: FP8 weights, FP8 KV cache, the workload's input + output a sequence)
# holds it on that node. The default concurrency: the largest that fits, or the seed's own where it fits.
GPU_MEMORY_GB = {"h200": 141.0, "mi300x": 192.0}
WORKLOAD = {"v3": dict(preset="deepseek-v3", input_len=2000, output_len=100, seed_concurrency=4096),
            "step3": dict(preset="step3", input_len=4096, output_len=256, seed_concurrency=256)}
# MTP (k draft tokens a step): the per-rank step with speculation over the plain one, projected to the
# full depth from two measured layer counts (scripts/bench_spec_decode.py --layers A,B; BENCHMARKS.md):
# tokens a rank -> {k: (ratio, source)}. Empty: no measurement at depth yet, so no MTP row is printed.
_SRC = "H100 2026-12-06d, bench_spec_decode --layers 2,4 projected to 61, context 1000, bf16 weights"
MTP_STEP_RATIO: dict = {"v3": {16: {1: (1.08, _SRC), 2: (1.21, _SRC)}, 64: {1: (1.29, _SRC), 2: (1.44, _SRC)},
                               197: {1: (1.60, _SRC), 2: (2.17, _SRC)}}, "step3": {}}
# The split's own cost: per-rank step with DBO on over off, collectives mocked (mock GPU topology,
# DeepSeek-V3 shapes, 3 layers; benchmarks/2026-12-04b run3/run4): tokens per rank -> cost.
DBO_COST = {64: 3.116 / 2.458 - 1, 256: 7.337 / 5.971 - 1}


def interp(points: dict, x: float) -> float:
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(i for i in xs if i >= x)
    lo = max(i for i in xs if i <= x)
    return points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def expected_remote_ranks(m: dict, ranks: int) -> float:
    """Expected number of other ranks a token's top-k experts sit on (uniform routing), capped by the
    model's node-limited routing."""
    E, k, per = m["experts"], m["top_k"], m["experts"] // ranks
    p_absent = math.comb(E - per, k) / math.comb(E, k)
    return min((ranks - 1) * (1 - p_absent), m["max_ranks_per_token"] * (ranks - 1) / ranks)


@functools.lru_cache(maxsize=None)
def fitting_concurrency(model: str, link: str, ranks: int = 8) -> int:
    """The most sequences of the model's workload a node of ``link``'s GPUs holds (FP8 weights and KV cache,
    DP attention + EP experts over ``ranks`` GPUs, vLLM's 0.9 of memory less 6 GB a GPU reserved)."""
    w = WORKLOAD[model]
    r = plan(preset(w["preset"]), f"dp{ranks}-ep{ranks}", "fp8", GPU_MEMORY_GB[link], 0.9, 6.0, "fp8",
             w["input_len"], w["output_len"])
    return r["seqs_per_node"] if r["fits"] else 0


def default_concurrency(model: str, link: str) -> int:
    """The seed's concurrency where it fits the node, else the largest that does."""
    return min(WORKLOAD[model]["seed_concurrency"], fitting_concurrency(model, link))


def project(model: str, C: int, link: str, efficiency: float, latency: float, ranks: int = 8,
            acceptance: tuple = ()) -> dict:
    m = MEASURED[model]
    T = C / ranks
    per_layer_scaled = {t: s / layers * m["full_layers"] for t, (s, layers, _) in m["points"].items()}
    compute = interp(per_layer_scaled, T)
    H, L = m["hidden"], m["moe_layers"]
    bw = LINKS[link][0] * efficiency
    remote = expected_remote_ranks(m, ranks)
    exchange = {
        # static [ranks, T, H] bf16 both ways (ids int32 and weights f32 [ranks, T, k] packed into the
        # dispatch buffer): 2 collectives a layer
        "a2a (static buffers, bf16)": (L * (ranks - 1) * T * (2 * H * 2 + m["top_k"] * 8) / bw + L * 2 * latency),
        "rows that exist, bf16": L * T * remote * (2 * H * 2) / bw + L * 2 * latency,
        "rows that exist, FP8 dispatch": L * T * remote * (H * (1 + 4 / 128) + H * 2) / bw + L * 2 * latency,
    }
    cost = interp(DBO_COST, T)
    out = {"model": model, "concurrency": C, "tokens_per_rank": T, "link": link, "compute_s": compute,
           "dbo_cost": cost, "remote_ranks_per_token": remote, "variants": {}}
    for name, ex in exchange.items():
        off = compute + ex
        on = max(compute * (1 + cost), ex)
        out["variants"][name] = {"exchange_s": ex, "step_s": off, "step_dbo_s": on,
                                 "tok_s": C / off, "tok_s_dbo": C / on}
    # MTP: the step costs ratio x compute and moves k + 1 rows a sequence; a sequence gains sum_i a^i tokens.
    out["mtp"] = {}
    for k, ratios in sorted(_mtp_ratios(model).items()):
        ratio = interp({t: r for t, (r, _) in ratios.items()}, T)
        ex = exchange["rows that exist, FP8 dispatch"] * (k + 1)
        step = max(compute * ratio * (1 + cost), ex)
        out["mtp"][k] = {"step_ratio": ratio, "exchange_s": ex, "step_dbo_s": step,
                         "tok_s_dbo": {str(a): C * sum(a ** i for i in range(k + 1)) / step for a in acceptance}}
    return out


def _mtp_ratios(model: str) -> dict:
    """{k: {tokens a rank: (ratio, source)}} from MTP_STEP_RATIO."""
    out: dict = {}
    for t, by_k in MTP_STEP_RATIO[model].items():
        for k, v in by_k.items():
            out.setdefault(k, {})[t] = v
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v3,step3", help="comma list of v3 / step3")
    p.add_argument("--concurrency", default=None,
                   help="node concurrency list; default: the seed's (v3 4096, step3 256) where the node holds it, "
                        "else the largest that fits (scripts/plan_memory.py); one that does not fit is not projected")
    p.add_argument("--link", default="h200,mi300x", help="the node's GPUs (memory and link), comma list of "
                   + " / ".join(LINKS))
    p.add_argument("--acceptance", default="0.6,0.8", help="MTP per-position acceptance rates to project")
    p.add_argument("--efficiency", type=float, default=0.75,
                   help="fraction of the link's bandwidth an all-to-all reaches (assumed; DeepEP's intranode "
                        "kernels report ~155 GB/s of H800's 200 GB/s a direction)")
    p.add_argument("--latency-us", type=float, default=15.0, help="fixed cost of one collective (assumed)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not 0 < a.efficiency <= 1:
        raise SystemExit(f"--efficiency must be in (0, 1], got {a.efficiency}")
    acceptance = tuple(float(x) for x in a.acceptance.split(",")) if a.acceptance else ()
    if any(not 0 <= x <= 1 for x in acceptance):
        raise SystemExit(f"--acceptance: rates must be in [0, 1], got {a.acceptance}")
    results = []
    print("A MODEL (scripts/project_node.py): per-rank compute measured on one GPU (H100 or H200, each point "
          "says), exchange from bytes / assumed bandwidth; only concurrencies the node's memory holds.\n")
    for model in a.model.split(","):
        if model not in MEASURED:
            raise SystemExit(f"--model: unknown {model!r}; choose from {sorted(MEASURED)}")
        m = MEASURED[model]
        print(f"== {model}: {m['preset']}, {m['full_layers']} layers ({m['moe_layers']} MoE); measured per-rank "
              f"steps: " + "; ".join(f"T={t}: {s * 1e3:.2f} ms ({n} layers, {src})"
                                     for t, (s, n, src) in m["points"].items()))
        print(f"   to beat: {m['targets']}")
        for link in a.link.split(","):
            if link not in LINKS:
                raise SystemExit(f"--link: unknown {link!r}; choose from {sorted(LINKS)}")
            fit = fitting_concurrency(model, link)
            cs = [int(c) for c in a.concurrency.split(",")] if a.concurrency else [default_concurrency(model, link)]
            print(f"   node {link}: 8 x {GPU_MEMORY_GB[link]:g} GB holds {fit:,} sequences of "
                  f"{WORKLOAD[model]['input_len']} + {WORKLOAD[model]['output_len']} tokens (FP8 weights and KV cache)")
            print(f"   link {link}: {LINKS[link][1]}, x {a.efficiency} efficiency, {a.latency_us} us a collective")
            print(f"   {'C':>5} {'T/rank':>6} {'compute':>9} {'exchange':>30} {'no DBO':>16} {'DBO (bound)':>16}")
            for C in cs:
                if C > fit:
                    print(f"   {C:>5}  does not fit this node (largest: {fit:,}): not projected")
                    results.append({"model": model, "concurrency": C, "link": link, "fits": False, "fit": fit})
                    continue
                r = dict(project(model, C, link, a.efficiency, a.latency_us * 1e-6, acceptance=acceptance),
                         fits=True, fit=fit)
                results.append(r)
                for name, v in r["variants"].items():
                    print(f"   {C:>5} {r['tokens_per_rank']:>6.0f} {r['compute_s'] * 1e3:>7.1f}ms "
                          f"{name:>22} {v['exchange_s'] * 1e3:>5.1f}ms {v['tok_s']:>9,.0f} tok/s {v['tok_s_dbo']:>9,.0f} tok/s")
                for k, v in r["mtp"].items():
                    rates = ", ".join(f"{x} accepted: {t:,.0f} tok/s" for x, t in v["tok_s_dbo"].items())
                    print(f"   {C:>5} MTP k={k}: step x {v['step_ratio']:.2f} (projected to depth), FP8 dispatch of "
                          f"{k + 1} rows, DBO bound: {rates}")
                if not r["mtp"]:
                    print(f"   {C:>5} MTP: no step measured at depth (MTP_STEP_RATIO): not projected")
            print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "links": LINKS, "dbo_cost": DBO_COST, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
