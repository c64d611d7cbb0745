#!/usr/bin/env python
"""Offline decode benchmark on one device: random weights at a named shape, a full decode
batch at the given concurrency and input length (prefill excluded from the timing), then
timed decode steps. Prints the step time beside the two floors measured in the same run:
bytes one step must read over the measured copy bandwidth, FLOPs over the measured bf16
matmul rate.

  python scripts/bench_decode.py --preset deepseek-v2-lite --layers 6 --concurrency 64 \
      --input-len 1000 --parallel none,dp1-ep1 --json out.json
  python scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 1024 --input-len 2000 \
      --kernels auto,xla --fill random --peer

  python scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 64,1024 --host-overhead --fill random

--host-overhead times the engine's decode loop, synchronous and overlapped (async scheduling), against
the same compiled step called alone back to back with its inputs on the device: host overhead =
(engine step - device step) / engine step.

--fill prefill (default) runs the real prefill; --fill random admits the batch as if prefilled
(blocks allocated, every prompt position's cache row written with random values, one token
appended): the decode steps then read a full-length cache exactly as after a prefill, at a
fraction of the set-up time. --kernels takes a comma list; the weights are generated once and
shared by the runs. --peer runs HF transformers in a child process before JAX touches the
GPU (JAX reserves most of the GPU's memory for itself once it starts).
"""

import argparse
import collections
import functools
import gc
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.benchmark.decode_setup import (  # noqa: F401  (also this script's names: tests and callers use them)
    add_engine_flags, bench_hf_config, build_decode_batch, capture_decode_args, capture_step_programs, engine_settings,
    fill_without_prefill,
    step_floor, weight_kw)
from moejax.benchmark.ep import time_dispatch
from moejax.benchmark.roofline import measure_copy_bandwidth, measure_matmul_rate, time_call
from moejax.engine_args import EngineArgs
from moejax.kernels.common import kernel_mode, kernel_settings
from moejax.layers.experts import ExpertWeights, grouped_expert_mlp
from moejax.layers.paged_attention import mfa_decode_attention, mla_decode_attention
from moejax.config import EngineConfig
from moejax.models.registry import family_of, parse_model_config
from moejax.parallel.config import ParallelConfig
from moejax.parallel.sharding import make_mesh
from moejax.tiny.transformers_checkpoint import hf_classes


def time_components(cfg, a, ctx, layout: str = "none"):
    """Per-step time of attention, routed experts and (over a mesh) the dispatch/combine exchange,
    each timed alone at one rank's shapes (one layer's op x the number of such layers); "rest" is
    the step minus all of them. Over a mesh, a rank attends its B/N sequences and its E/N experts
    compute B/N x top-k rows (uniform routing)."""
    key = jax.random.key(1)
    ranks = 1
    if layout != "none":
        pc = ParallelConfig.load(layout)
        ranks = pc.num_ranks
    B, L = -(-a.concurrency // ranks), cfg.num_hidden_layers
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    bs = 16
    nb = -(-ctx // bs)
    out = {}
    with kernel_mode(a.kernels), kernel_settings(EngineArgs.create(**engine_settings(a))):
        if hasattr(cfg, "kv_lora_rank"):
            C, R, nh = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
            cache = (0.1 * jax.random.normal(key, (B * nb * bs, C + R))).astype(jnp.bfloat16)
            q = (0.1 * jax.random.normal(key, (B, nh, C + R))).astype(jnp.bfloat16)
            tables = jnp.arange(B * nb, dtype=jnp.int32).reshape(B, nb)
            fn = jax.jit(lambda q, c, t, l: mla_decode_attention(q[..., :C], q[..., C:], c, t, l, bs, 0.1))
        else:
            D = cfg.head_dim
            cache = (0.1 * jax.random.normal(key, (B * nb * bs, 2 * D))).astype(jnp.bfloat16)
            q = (0.1 * jax.random.normal(key, (B, cfg.num_attention_heads, D))).astype(jnp.bfloat16)
            tables = jnp.arange(B * nb, dtype=jnp.int32).reshape(B, nb)
            fn = jax.jit(lambda q, c, t, l: mfa_decode_attention(q, c, t, l, bs, D ** -0.5, 1))
        lens = jnp.full((B,), ctx, jnp.int32)
        out["attention"] = L * time_call(fn, q, cache, tables, lens)
        if n_moe:
            E, H, I, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
            El = E // ranks
            w = lambda s: (0.02 * jax.random.normal(key, s)).astype(jnp.bfloat16)  # noqa: E731
            x = w((B * k, H))
            sizes = jnp.full((El,), B * k // El, jnp.int32).at[0].add(B * k - El * (B * k // El))  # uniform
            fn = jax.jit(lambda x, s, g, u, d: grouped_expert_mlp(x, s, ExpertWeights(g, u, d)))
            out["moe"] = n_moe * time_call(fn, x, sizes, w((El, H, I)), w((El, H, I)), w((El, I, H)))
            if ranks > 1:
                t, _ = time_dispatch(make_mesh(ranks), pc.moe_backend, B, H, E, k)
                out["dispatch_combine"] = n_moe * t
    return out


def run_peer(hf, a):
    """HF transformers (PyTorch, bf16, its own generate with a static cache) at the same batch and
    lengths: decode tokens/s with its prefill subtracted. DeepSeek families only (no Step3 in HF)."""
    import torch  # optional: only the peer needs it
    cfg_cls, model_cls = hf_classes(hf["model_type"])
    kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = model_cls(cfg_cls(**kw)).to(torch.bfloat16).eval()
    ids = torch.randint(2, hf["vocab_size"], (a.concurrency, a.input_len), device=dev)

    def gen(n):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                           pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)  # warm-up
    prefill = gen(1)
    total = gen(1 + a.output_len)
    return a.concurrency * a.output_len / max(total - prefill, 1e-9)


PEER_TIMEOUT_S = int(os.environ.get("MOEJAX_PEER_TIMEOUT", "900"))


def peer_in_child(argv) -> tuple[float | None, str | None]:
    """Runs the transformers peer in a child process (this one has not touched the GPU yet), so its
    memory is free again for JAX. Returns (tokens/s, None) or (None, why it did not run)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "peer.json")
        argv = [x for x in argv if x != "--peer"]
        if "--json" in argv:  # the child writes its own file
            i = argv.index("--json")
            argv = argv[:i] + argv[i + 2:]
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--peer-only", "--json", out],
                                  capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"stopped after {PEER_TIMEOUT_S} s (MOEJAX_PEER_TIMEOUT)"
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return None, lines[-1][:300] if lines else f"exit code {proc.returncode}"
        with open(out) as f:
            return json.load(f)["peer_tok_per_s"], None


def print_compile_time(eng, kernels) -> None:
    """The decode program built again (one more step's arguments): seconds to trace and lower, seconds in
    XLA, and its custom calls by target (a Pallas/Triton kernel each): where a cold start's time goes."""
    for name, fn, args, kw in capture_step_programs(eng):
        if name != "decode":
            continue
        jax.clear_caches()  # JAX keeps the lowering and the executable in memory: build both again
        t0 = time.perf_counter()
        lowered = fn.lower(*args, **kw)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))
        print(f"  compile (kernels={kernels}, {eng.runner.cfg.num_hidden_layers} layers): trace + lower "
              f"{t1 - t0:.2f} s, XLA {t2 - t1:.2f} s; custom calls {dict(calls) or 'none'}", flush=True)


def run_one(hf, parallel, kernels, a, weight_dtype="bf16", async_scheduling=None, device_steps=0):
    """Engine decode step times [s] at the point (the loop of --loop unless ``async_scheduling`` is given);
    with ``device_steps``, also the compiled step's own time (device_step_time). Returns (times, memory,
    device step time or None)."""
    if async_scheduling is None:
        async_scheduling = a.loop == "async"
    m, eng, seqs = build_decode_batch(hf, parallel, kernels, a, weight_dtype, async_scheduling)
    times = []
    while len(times) < a.warmup + a.steps:
        if any(s.is_finished for s in seqs):
            break  # the batch must stay full: raise --output-len for more steps
        compiled = eng.runner.trace_counts["decode"] + eng.runner.trace_counts["feed"]
        t = time.perf_counter()
        kind, stepped = eng.step()
        assert kind == "decode"
        if eng.runner.trace_counts["decode"] + eng.runner.trace_counts["feed"] == compiled:  # compiled: not timed
            times.append(time.perf_counter() - t)
    times = times[a.warmup:]
    if not times:
        raise SystemExit(f"no decode step was timed: --output-len {a.output_len} leaves no steps after "
                         f"{a.warmup} warm-up steps")
    if getattr(a, "compile_time", False) and not any(s.is_finished for s in seqs):
        print_compile_time(eng, kernels)
    memory = decode_memory(eng) if a.memory and not any(s.is_finished for s in seqs) else None
    device = device_step_time(eng, device_steps) if device_steps and not any(s.is_finished for s in seqs) else None
    del m, eng, seqs
    gc.collect()  # the engine's reference cycles hold the KV cache: free it before the next variant fills its own
    return times, memory, device


def device_step_time(eng, n: int) -> float:
    """The engine's compiled decode step alone: one more engine step's arguments captured and put on
    the device, then n calls back to back (the donated cache chained through) timed to the last one's
    completion. The engine's step time minus this is the host's share (what the loop does not hide)."""
    r = eng.runner
    real, args, kw = capture_decode_args(eng)
    real = functools.partial(real, **kw)
    params, routing, _, *rest = args
    rest = jax.device_put(rest)  # host arrays to the device once: the timed calls copy nothing
    cache = real(params, routing, r.cache, *rest)[0]  # warm (already compiled: same shapes)
    jax.block_until_ready(cache)
    rounds = []
    for _ in range(3):  # the median of three rounds: one disturbed round does not move it
        t = time.perf_counter()
        for _ in range(n):
            cache = real(params, routing, cache, *rest)[0]
        jax.block_until_ready(cache)
        rounds.append((time.perf_counter() - t) / n)
    r.cache = cache
    return statistics.median(rounds)


def host_overhead(hf, a, results) -> None:
    """--host-overhead: the engine's decode step time, synchronous and overlapped loops, against the
    device time of the same compiled step called alone; host overhead = (engine - device) / engine."""
    kern, layout, wd = a.kernels.split(",")[0], a.parallel.split(",")[0], a.weight_dtype.split(",")[0]
    out = results.setdefault("host_overhead", {})
    for mode in ("sync", "async"):
        times, _, device = run_one(hf, layout, kern, a, wd, async_scheduling=mode == "async", device_steps=a.steps)
        if device is None:
            raise SystemExit("--host-overhead: the batch finished before the device timing: raise --output-len")
        engine = statistics.median(times)
        out[mode] = {"engine_step_s": engine, "device_step_s": device, "host_overhead": (engine - device) / engine,
                     "steps": len(times)}
        print(f"{mode:>6} loop: engine step {engine * 1e3:.3f} ms, device step alone {device * 1e3:.3f} ms, "
              f"host overhead {out[mode]['host_overhead'] * 100:.1f}% (c{a.concurrency}, {layout}, {kern})")
        sys.stdout.flush()


def decode_memory(eng) -> dict:
    """XLA's memory analysis of the compiled decode step (one more step, its arguments captured).
    Temporary bytes of the order of the cache's size mean the step copies the cache (it is
    donated and written in place otherwise). Costs one more compilation."""
    r = eng.runner
    real, args, kw = capture_decode_args(eng)
    ma = real.lower(*args, **kw).compile().memory_analysis()
    out = {"cache_bytes": int(r.cache.nbytes), "temp_bytes": int(ma.temp_size_in_bytes),
           "argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
           "alias_bytes": int(ma.alias_size_in_bytes)}
    mb = {k: f"{v / 1e6:.1f} MB" for k, v in out.items()}
    print(f"decode step memory: cache {mb['cache_bytes']}, temporaries {mb['temp_bytes']}, "
          f"arguments {mb['argument_bytes']} (aliased to outputs {mb['alias_bytes']})")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (first layer dense)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--concurrency", default="64",
                    help="comma list: one run per value (weights built once per --weight-dtype; JSON per point)")
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--parallel", default="none", help="comma list: none (plain path) and/or configs, e.g. none,dp1-ep1")
    ap.add_argument("--kernels", default="xla", help="comma list of auto / pallas / xla (one run each)")
    ap.add_argument("--fill", choices=["prefill", "random"], default="prefill",
                    help="how the batch's cache is filled before the timed steps (see above)")
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)  # the --peer child process
    ap.add_argument("--memory", action="store_true",
                    help="also report XLA's memory analysis of the decode step (one more step and compile)")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--weight-dtype", default="bf16",
                    help="comma list of bf16 / fp8 (128x128 block-scaled weights; one run each, floors from each's "
                         "bytes) / fp8:<layer types joined by +> (only those FP8, e.g. fp8:experts+shared_experts)")
    ap.add_argument("--components", action="store_true", help="also time attention and MoE alone at the step's shapes")
    ap.add_argument("--peer", action="store_true", help="also run HF transformers (PyTorch) at the same batch and lengths")
    ap.add_argument("--loop", choices=["async", "sync"], default="async",
                    help="the engine loop timed: async (the engine's default: step t+1 built while t runs) or sync")
    ap.add_argument("--host-overhead", action="store_true",
                    help="instead of the variants: the engine's step time with the synchronous and the overlapped "
                         "(async scheduling) loop against the compiled step alone (first kernels/parallel/weights)")
    ap.add_argument("--compile-time", action="store_true",
                    help="also build the decode program again and print its trace/lower and XLA seconds "
                         "(run with the persistent compilation cache off)")
    ap.add_argument("--json", default=None)
    add_engine_flags(ap)  # --dtype, --fp8-variant, --moe-kernel, --mla-kernel, ... (moejax/engine_args.py)
    a = ap.parse_args(argv)
    try:
        concs = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        raise SystemExit(f"--concurrency: {a.concurrency!r} is not a comma list of integers") from None
    if any(c < 1 for c in concs):
        raise SystemExit(f"--concurrency: {a.concurrency!r}: every value must be positive")
    if len(concs) == 1:
        a.concurrency = concs[0]
        return _bench(a, argv)
    if a.peer or a.components:
        raise SystemExit("--peer and --components take a single --concurrency")
    stem = a.json[:-5] if a.json and a.json.endswith(".json") else a.json
    for wd in a.weight_dtype.split(","):  # weight format outer: its weights are built once for every point
        for c in concs:
            b = argparse.Namespace(**vars(a))
            b.concurrency, b.weight_dtype = c, wd
            b.json = stem and f"{stem}_c{c}_{wd.replace(':', '-').replace('+', '-')}.json"
            print(f"\n=== concurrency {c}, {wd} weights ===")
            _bench(b, argv)


def _bench(a, argv):
    kernel_modes = a.kernels.split(",")
    for k in kernel_modes:
        if k not in ("auto", "pallas", "xla"):
            raise SystemExit(f"--kernels: {k!r} is not one of auto, pallas, xla")
    hf = bench_hf_config(a.preset, a.layers, a.set)
    cfg = parse_model_config(hf)
    if a.peer_only:  # child process: no JAX device use at all
        tps = run_peer(hf, a)
        with open(a.json, "w") as f:
            json.dump({"peer_tok_per_s": tps}, f)
        return
    peer = peer_note = None
    if a.peer:
        if not family_of(cfg).transformers_classes:
            peer_note = f"transformers has no {family_of(cfg).name.capitalize()} model"
        else:
            peer, peer_note = peer_in_child(argv if argv is not None else sys.argv[1:])
    bw, rate = measure_copy_bandwidth(), measure_matmul_rate()
    ctx = a.input_len + a.warmup + a.steps // 2
    kv_itemsize = 1 if a.kv_dtype == "fp8" else 2
    weight_dtypes = a.weight_dtype.split(",")
    fp8_of = {wd: EngineConfig.create(cfg, **weight_kw(wd)).fp8 for wd in weight_dtypes}
    nbytes, flops = step_floor(cfg, a.concurrency, ctx, kv_itemsize=kv_itemsize, fp8=fp8_of[weight_dtypes[0]])
    floor = max(nbytes / bw, flops / rate)
    print(f"device: {jax.devices()[0].device_kind}; measured copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} "
          f"TFLOP/s; {a.loop} engine loop")
    print(f"step floors: memory {nbytes / bw * 1e3:.3f} ms ({nbytes / 1e9:.2f} GB), compute {flops / rate * 1e3:.3f} ms "
          f"({flops / 1e12:.2f} TFLOP)")

    def floor_for(layout: str, wd: str) -> float:
        """One device's floor, or the node's over a mesh (each card measured like this one)."""
        n = 1 if layout == "none" else ParallelConfig.load(layout).num_ranks
        b, f = step_floor(cfg, a.concurrency, ctx, kv_itemsize=kv_itemsize, ranks=n, fp8=fp8_of[wd])
        return max(b / (n * bw), f / (n * rate))
    results = {"preset": a.preset, "layers": cfg.num_hidden_layers, "concurrency": a.concurrency, "loop": a.loop,
               "input_len": a.input_len, "device": jax.devices()[0].device_kind, "copy_bw": bw, "matmul_rate": rate,
               "floor_s": floor, "runs": {}}
    base = None
    floors: dict[tuple, float] = {}  # per (layout, weight dtype): each traces the model's shapes once
    results["runs_by_kernels"] = {}
    results["runs_by_weight_dtype"] = {}

    def save():
        if a.json:  # after every variant: a later one that fails loses nothing measured
            with open(a.json, "w") as f:
                json.dump(results, f, indent=2)

    if a.host_overhead:
        host_overhead(hf, a, results)
        save()
        return

    for wd, kern, p in itertools.product(weight_dtypes, kernel_modes, a.parallel.split(",")):
        t0, why = time.perf_counter(), None
        label = kern if len(weight_dtypes) == 1 else f"{kern}, {wd} weights"
        try:
            t, memory, _ = run_one(hf, p, kern, a, wd)
        except jax.errors.JaxRuntimeError as e:  # e.g. out of memory: record it, run the other variants
            why = str(e).strip().splitlines()[0][:300]
        if why is not None:
            gc.collect()  # only now: inside the except block its traceback still held the variant's cache
            results.setdefault("failed", {}).setdefault(label, {})[p] = why
            print(f"{p:>12} [{label}]: failed after {time.perf_counter() - t0:.0f} s: {why}")
            save()
            continue
        med = statistics.median(t)
        base = base or med
        fl = floors.setdefault((p, wd), floor_for(p, wd))
        r = {"median_step_s": med, "p90_step_s": float(np.percentile(t, 90)), "tok_per_s": a.concurrency / med,
             "floor_s": fl, "floor_fraction": fl / med, "vs_first": med / base,
             "steps": len(t), **({"memory": memory} if memory else {})}
        results["runs_by_weight_dtype"].setdefault(wd, {}).setdefault(kern, {})[p] = r
        if wd == weight_dtypes[0]:
            results["runs_by_kernels"].setdefault(kern, {})[p] = r
            if kern == kernel_modes[0]:
                results["runs"][p] = r
        print(f"{p:>12} [{label}]: median step {med * 1e3:.3f} ms, p90 {r['p90_step_s'] * 1e3:.3f} ms, "
              f"{r['tok_per_s']:.0f} tok/s, {r['floor_fraction'] * 100:.1f}% of floor, x{r['vs_first']:.3f} vs first "
              f"({time.perf_counter() - t0:.0f} s with build and compile)")
        sys.stdout.flush()
        save()
    a.kernels = kernel_modes[0]  # components use the first mode
    if a.components and results["runs"]:
        comp = time_components(cfg, a, ctx, a.parallel.split(",")[0])
        step = results["runs"][a.parallel.split(",")[0]]["median_step_s"]
        comp["rest"] = max(step - sum(comp.values()), 0.0)
        results["components_s"] = comp
        print("components (each timed alone): " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in comp.items()))
    if a.peer:
        if peer is not None:
            results["peer_tok_per_s"] = peer
            print(f"peer (transformers, bf16, static cache): {peer:.0f} decode tok/s")
        else:
            results["peer_note"] = peer_note
            print(f"peer: not run ({peer_note})")
    save()


if __name__ == "__main__":
    main()
