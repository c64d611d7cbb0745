#!/usr/bin/env python
"""Expert parallelism on every local device: the multi-GPU checks of issue 8, in one script.

  python scripts/bench_ep.py check                      # dp{N}-ep{N} vs one device, each backend, two routings
  python scripts/bench_ep.py dispatch --tokens 64 256   # dispatch + combine per MoE layer vs bytes / all-to-all rate
  python scripts/bench_ep.py eplb --skew 0.1            # contiguous vs balanced placement on a skewed router

N = all local devices (--ranks to use fewer). On a CPU host, run with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (small shapes: --smoke). What was run where is
recorded in BENCHMARKS.md: as of 2026-12-02 this script has run on 8 CPU host devices only; no
multi-GPU machine has been lent yet.

check: random weights (float32, matmuls at "highest" precision so that GPUs do not round to
TF32), the same model on one device and on dp{N}-ep{N}; prefill logits (relative error < 1e-5)
and 32 greedy decode tokens (equal) for 10 prompts of mixed lengths, with uniform routing and
with every choice forced onto rank 0's experts; backends a2a, replicated and (GPU) ragged.
dispatch: V3-shaped routing (hidden 7168, 256 experts, top-8) of T tokens per rank, the backend
alone with a 16-wide expert MLP (its compute is negligible next to the exchange), against the
bytes each rank sends and receives over the rate of a plain all_to_all of the same size.
eplb: a router skewed towards low expert ids (bias -skew * log(1 + id): Zipf-like popularity,
hot experts packed onto the first ranks), decode steps with the contiguous
placement and after one rebalance: per-rank (token, expert) pairs and median step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax import generate  # noqa: E402
from moejax.benchmark.ep import all_to_all_rate, time_dispatch  # noqa: E402
from moejax.engine.sampling_params import SamplingParams  # noqa: E402
from moejax.models.registry import abstract_params, parse_model_config  # noqa: E402
from moejax.parallel.dispatch import BACKENDS  # noqa: E402
from moejax.parallel.ffi_library import available as ffi_available  # noqa: E402
from moejax.parallel.sharding import make_mesh  # noqa: E402
from moejax.tiny.presets import preset  # noqa: E402
from moejax.model import random_model  # noqa: E402
from moejax.weights.random_params import random_device_params  # noqa: E402
from moejax.weights.param_tree import flatten, unflatten  # noqa: E402


def backends() -> list[str]:
    """The backends this platform runs: no ragged on XLA:CPU (no ragged all-to-all), ffi where its extension is built."""
    return [b for b in BACKENDS if (b != "ragged" or jax.default_backend() != "cpu") and (b != "ffi" or ffi_available())]


def layout(n: int, backend: str, **extra) -> str:
    d = tempfile.mkdtemp(prefix="moejax-ep-")
    path = os.path.join(d, f"dp{n}-ep{n}-{backend}.yaml")
    with open(path, "w") as f:
        f.write(f"data_parallel_size: {n}\nexpert_parallel_size: {n}\nmoe_backend: {backend}\n")
        f.writelines(f"{k}: {v}\n" for k, v in extra.items())
    return path


def skew_router(params, bias: np.ndarray):
    """Adds ``bias`` [E] to every MoE layer's e_score_correction_bias (selection only, not weights)."""
    flat = flatten(params)
    for path in flat:
        if path[-1] == "e_score_correction_bias":
            flat[path] = flat[path] + jnp.asarray(bias, flat[path].dtype)
    return unflatten(flat)


def model_config(a, n: int) -> dict:
    if a.smoke:  # 4 experts per rank, top-4: every choice of a token can sit on one rank
        return preset("v3-tiny", n_routed_experts=4 * n, num_experts_per_tok=4, n_group=4, topk_group=2)
    return preset("v3-tiny", hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048,
                  n_routed_experts=8 * n, num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=4,
                  vocab_size=4096)


def load(hf, params, parallel=None, **kw):
    return random_model(hf, "float32", parallel=parallel, params=params, **{"max_model_len": 128, "max_num_seqs": 8,
                                                                            **kw})


def cmd_check(a, n: int) -> int:
    jax.config.update("jax_default_matmul_precision", "highest")
    hf = model_config(a, n)
    cfg = parse_model_config(hf)
    base = random_device_params(abstract_params(cfg, "float32"), seed=1, std=0.1)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, cfg.vocab_size, size=(8, 21))
    prompts = [rng.integers(2, cfg.vocab_size, size=int(rng.integers(3, 30))).tolist() for _ in range(10)]
    failures = 0
    print(f"{'routing':>12} {'backend':>10} {'prefill rel err':>16} {'greedy tokens':>14} {'max |dlogprob|':>15}")
    for routing in ("uniform", "adversarial"):
        bias = np.zeros(cfg.n_routed_experts)
        if routing == "adversarial":  # rank 0 holds experts [0, E/n): every choice lands there
            bias[:cfg.n_routed_experts // n] = 10.0
        params = skew_router(base, bias)
        single = load(hf, params)
        want = single.score(ids)
        ref = generate(single, prompts, max_new_tokens=32, ignore_eos=True, logprobs=True)
        del single
        for backend in backends():
            ep = load(hf, params, layout(n, backend))
            err = float(np.linalg.norm(ep.score(ids) - want) / np.linalg.norm(want))
            out = generate(ep, prompts, max_new_tokens=32, ignore_eos=True, logprobs=True)
            same = sum(x.token_ids == y.token_ids for x, y in zip(ref, out))
            dlp = max(float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs)))) for x, y in zip(ref, out)
                      if x.token_ids == y.token_ids) if same else float("nan")
            ok = err < 1e-5 and same == len(prompts)
            failures += not ok
            print(f"{routing:>12} {backend:>10} {err:16.2e} {same:>8}/{len(prompts):<5} {dlp:15.2e}"
                  f"{'' if ok else '   MISMATCH'}", flush=True)
            del ep
    print("check: " + ("all equal" if not failures else f"{failures} mismatch(es)"))
    return 1 if failures else 0


def cmd_dispatch(a, n: int) -> int:
    mesh = make_mesh(n)
    H, E, k = (64, 4 * n, 4) if a.smoke else (7168, 256, 8)
    print(f"ranks {n}, hidden {H}, {E} experts top-{k}, bf16 activations; per MoE layer, dispatch + combine")
    print(f"{'tokens/rank':>11} {'backend':>10} {'time us':>9} {'bytes/rank MB':>13} {'GB/s/rank':>10} "
          f"{'a2a probe GB/s':>14} {'of probe':>8}")
    for T in a.tokens:
        probe = all_to_all_rate(mesh, (n - 1) * T * H * 2)
        for backend in backends():
            t, moved = time_dispatch(mesh, backend, T, H, E, k, seed=T)
            print(f"{T:>11} {backend:>10} {t * 1e6:9.1f} {moved / 1e6:13.2f} {moved / t / 1e9:10.1f} "
                  f"{probe / 1e9:14.1f} {moved / t / probe:8.2f}", flush=True)
    return 0


def cmd_eplb(a, n: int) -> int:
    hf = model_config(a, n)
    cfg = parse_model_config(hf)
    E = cfg.n_routed_experts
    bias = -a.skew * np.log1p(np.arange(E))  # popularity falls with the expert id: contiguous ranks skew
    params = skew_router(random_device_params(abstract_params(cfg, "float32"), seed=2, std=0.1), bias)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, size=16).tolist() for _ in range(a.batch)]
    print(f"ranks {n}, {E} experts top-{cfg.num_experts_per_tok}, router bias -{a.skew} log(1 + id), "
          f"batch {a.batch}; per-rank (token, expert) pairs of the last decode step, summed over MoE layers")
    for name, extra in (("contiguous", {}), ("balanced", {"eplb_interval": a.warmup, "eplb_window": a.warmup})):
        m = load(hf, params, layout(n, "a2a", **extra), max_num_seqs=max(1, a.batch // n))
        eng = m.engine
        seqs = [eng.add_request(p, SamplingParams(max_new_tokens=a.warmup + a.steps + 2, ignore_eos=True))
                for p in prompts]
        while eng.scheduler.waiting or eng.scheduler.prefilling:
            eng.step()
        times = []
        for i in range(a.warmup + a.steps):  # the balanced run rebalances once, after the warm-up steps
            t = time.perf_counter()
            eng.step()
            if i >= a.warmup:
                times.append(time.perf_counter() - t)
        per_rank = np.asarray(eng.runner.last_dispatched).sum(1)
        print(f"{name:>11}: per-rank pairs {per_rank.tolist()}  max/mean {per_rank.max() / per_rank.mean():.3f}  "
              f"median step {statistics.median(times) * 1e3:.2f} ms", flush=True)
        del m, eng, seqs
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("check", "dispatch", "eplb"))
    ap.add_argument("--ranks", type=int, default=None, help="devices to use (default: all)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512], help="dispatch: tokens per rank")
    ap.add_argument("--skew", type=float, default=0.1, help="eplb: router bias -skew * log(1 + expert id)")
    ap.add_argument("--batch", type=int, default=64, help="eplb: sequences over the node")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    a = ap.parse_args(argv)
    n = a.ranks or len(jax.devices())
    if n < 2:
        print(f"only {len(jax.devices())} device(s): expert parallelism needs at least 2 "
              "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
        return 2
    print(f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind} ({jax.default_backend()})")
    return {"check": cmd_check, "dispatch": cmd_dispatch, "eplb": cmd_eplb}[a.what](a, n)


if __name__ == "__main__":
    sys.exit(main())
