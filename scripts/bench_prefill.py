#!/usr/bin/env python
"""Prefill benchmark on one device: random weights at a named shape, one jitted prefill step
(every layer, the cache written, the last token's logits) per batch x length point, timed for
each attention path in the same process, beside the compute floor measured in the same run
(the step's FLOPs, attention included, over the measured bf16 matmul rate).

  python scripts/bench_prefill.py --preset deepseek-v3-ep8-rank,deepseek-v2-lite,step3-ep8-rank --layers 2 \\
      --points 1x2048,1x8192,1x32768,8x2048,32x2048 --kernels auto,xla,full --json prefill.json
  python scripts/bench_prefill.py --check --sweep    # kernel vs float64 on the device; its tilings alone
  python scripts/bench_prefill.py --smoke            # tiny models on the CPU, in seconds
  python scripts/bench_prefill.py --preset deepseek-v2-lite --mixed 2000,30,500,1200,64,17,900,300

--mixed LENS: one prefill step of prompts of those lengths (a comma list; several lists joined by
"/") as the engine runs whole prompts, packed back to back in one stream (cu_seqlens, the stream
bucketed by model_runner.packed_bucket), against the same prompts padded to [B, next pow2 of the
longest] (the layout before packing), both on the "auto" path: step time, tokens computed and
useful input tokens/s.

--weight-dtype bf16,fp8: every point and path once per weight format (FP8: 128x128 block-scaled
weights, the GEMM scheme from --fp8-variant, "auto" by default: moejax/kernels/moe_fp8.pick_variant), in the
same process; FP8 rows are keyed "<path>+fp8" and carry speedup_vs_bf16. The floor stays the bf16
one (the step's FLOPs over the measured bf16 rate).

Paths (--kernels): "auto" / "pallas" / "xla": ``moejax.load(kernels=...)`` for the whole model
("auto" on GPU: the flash prefill kernel, moejax/kernels/prefill.plan, and the Pallas MoE;
"xla": the memory-bounded XLA blocked attention and ragged_dot experts); "attn-xla": "auto"
except prefill attention through the XLA blocked path; "full": "auto" except prefill attention
in the former form, the whole [B, heads, S, S] float32 score tensor (kept in this script only,
for comparison; points whose scores alone exceed --full-limit-gb are skipped). Per point and path: time per prefill step (median),
input tokens/s, fraction of the compute floor, attention alone (one layer's
``prefill_attention`` at the step's shapes, times the layers), XLA's memory analysis of the
compiled step (temporaries) and the device's peak bytes in use (process-wide: the maximum so
far, where the backend reports it). --layers keeps the first layer dense and the rest MoE;
the presets' own layer counts are 20 (deepseek-v3-ep8-rank), 27 (deepseek-v2-lite) and
16 (step3-ep8-rank).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

import moejax.layers.mfa as mfa_mod  # noqa: E402
import moejax.layers.mla as mla_mod  # noqa: E402
from moejax.benchmark.decode_setup import add_engine_flags, bench_hf_config, engine_settings, weight_kw  # noqa: E402
from moejax.benchmark.roofline import measure_matmul_rate, time_call  # noqa: E402
from moejax.config import EngineConfig  # noqa: E402
from moejax.engine.model_runner import packed_bucket  # noqa: E402
from moejax.kernels.common import pow2  # noqa: E402
from moejax.kernels import prefill  # noqa: E402
from moejax.kernels.common import kernel_mode  # noqa: E402
from moejax.layers.forward_batch import ForwardBatch  # noqa: E402
from moejax.kernels.common import einsum_f32  # noqa: E402
from moejax.layers.prefill_attention import prefill_attention  # noqa: E402
from moejax.models.registry import abstract_params, parse_model_config  # noqa: E402
from moejax.tiny.checkpoint import random_params  # noqa: E402
from moejax.model import random_model  # noqa: E402
from moejax.weights.random_params import random_device_params  # noqa: E402
from moejax.weights.param_tree import flatten, is_stacked_expert  # noqa: E402
from pallas_kernels.flash_prefill_attention import flash_prefill_attention  # noqa: E402

BF16 = jnp.bfloat16


# ------------------------------------------------------------------ the former full-score path
def full_score_attention(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale, q_rope=None, k_rope=None,
                         v_offset=None, v_dim=None, out_dtype=jnp.float32, return_lse=False, mode=None):
    """Prefill attention as moejax computed it before layers/prefill_attention.py: the whole
    [B, heads, S, S] float32 score tensor, masked, softmaxed, cast and applied to V. One-shot only."""
    del ctx_lens, kv_start, return_lse, mode
    B, S, H, Dk = q.shape
    Hk = kv.shape[2]
    v_off, Dv = Dk if v_offset is None else v_offset, v_dim or Dk
    qg = q.reshape(B, S, Hk, H // Hk, Dk)
    s = einsum_f32("bqhgd,bkhd->bhgqk", qg, kv[..., :Dk])
    if q_rope is not None:
        s = s + einsum_f32("bqhgr,bkr->bhgqk", q_rope.reshape(B, S, Hk, H // Hk, -1), k_rope)
    s = s * scale
    pos = jnp.arange(S)
    mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < seq_lens[:, None, None])
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, kv[..., v_off:v_off + Dv])
    return o.reshape(B, S, H, Dv).astype(out_dtype)


PATHS = ("auto", "pallas", "xla", "attn-xla", "full")


@contextlib.contextmanager
def attention_path(path: str):
    """Traces everything inside with ``path``: "auto" / "pallas" / "xla" are kernel modes for the whole
    model (``moejax.load(kernels=...)``: MoE and attention); "attn-xla" and "full" keep "auto" for
    everything but prefill attention, which goes through the XLA blocked path or the former
    full-score form."""
    if path in ("auto", "pallas", "xla"):
        with kernel_mode(path):
            yield
        return
    attn = full_score_attention if path == "full" else functools.partial(prefill_attention, mode="xla")
    saved = mla_mod.prefill_attention, mfa_mod.prefill_attention
    mla_mod.prefill_attention = mfa_mod.prefill_attention = attn
    try:
        with kernel_mode("auto"):
            yield
    finally:
        mla_mod.prefill_attention, mfa_mod.prefill_attention = saved


# ------------------------------------------------------------------ shapes and FLOPs
def attention_shapes(cfg) -> dict:
    """One layer's prefill_attention operands: heads, K/V heads, key dim, rope dim, value dim, kv width."""
    if hasattr(cfg, "kv_lora_rank"):  # MLA, expanded
        dn, R, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        return dict(H=cfg.num_attention_heads, Hk=cfg.num_attention_heads, Dk=dn, R=R, Dv=dv, W=dn + dv,
                    scale=cfg.softmax_scale)
    D, G = cfg.head_dim, cfg.num_attention_groups
    return dict(H=cfg.num_attention_heads, Hk=G, Dk=D, R=0, Dv=D, W=2 * D, scale=cfg.softmax_scale)


def step_flops(cfg, B: int, S: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of one prefill step of B prompts of S tokens: 2 per active
    weight per token (routed experts scaled by top-k / E; the embedding is a lookup; lm_head for
    the last token only), and causal attention, S (S + 1) / 2 (query, key) pairs per sequence,
    2 (qk dim + v dim) FLOPs per pair per head."""
    active = head = 0
    for path, leaf in flatten(abstract_params(cfg, "bfloat16")).items():
        n = int(np.prod(leaf.shape))
        if path[0] == "embed_tokens":
            continue
        if path[0] == "lm_head":
            head += n
        elif is_stacked_expert(path):
            active += n * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            active += n
    a = attention_shapes(cfg)
    attn = cfg.num_hidden_layers * B * S * (S + 1) / 2 * a["H"] * 2 * (a["Dk"] + a["R"] + a["Dv"])
    return 2.0 * B * S * active + 2.0 * B * head, float(attn)


def peak_bytes():
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without stats)
        stats = {}
    return stats.get("peak_bytes_in_use")


# ------------------------------------------------------------------ timing
def time_steps(step, args, cache, iters: int, warmup: int) -> list[float]:
    """Seconds per call of a step whose third argument (the cache) is donated and returned first."""
    ts = []
    for i in range(warmup + iters):
        t = time.perf_counter()
        out = step(args[0], args[1], cache, *args[2:])
        cache = out[0]
        jax.block_until_ready(out)
        if i >= warmup:
            ts.append(time.perf_counter() - t)
    return ts


def attention_inputs(a: dict, B: int, S: int, dtype):
    k = jax.random.split(jax.random.key(1), 4)
    q = (jax.random.normal(k[0], (B, S, a["H"], a["Dk"]), jnp.float32) * 0.5).astype(dtype)
    kv = (jax.random.normal(k[1], (B, S, a["Hk"], a["W"]), jnp.float32) * 0.5).astype(dtype)
    qr = (jax.random.normal(k[2], (B, S, a["H"], a["R"]), jnp.float32) * 0.5).astype(dtype) if a["R"] else None
    kr = (jax.random.normal(k[3], (B, S, a["R"]), jnp.float32) * 0.5).astype(dtype) if a["R"] else None
    return q, kv, qr, kr, jnp.full((B,), S, jnp.int32)


def time_attention(a: dict, B: int, S: int, path: str, dtype, iters: int, warmup: int):
    """One layer's prefill attention alone (the step's shapes) through ``path``: (seconds, output)."""
    q, kv, qr, kr, lens = attention_inputs(a, B, S, dtype)
    kw = dict(scale=a["scale"], v_offset=a["Dk"], v_dim=a["Dv"], out_dtype=dtype)

    def fn(q, kv, qr, kr, lens):
        with attention_path(path):
            return mla_mod.prefill_attention(q, kv, lens, q_rope=qr, k_rope=kr, **kw)

    f = jax.jit(fn)
    t = time_call(f, q, kv, qr, kr, lens, iters=iters, warmup=warmup)
    out = f(q, kv, qr, kr, lens)
    del q, kv, qr, kr
    return t, out


def rel_err(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run_point(m, cfg, B: int, S: int, path: str, a, dtype, iters: int, warmup: int, outputs: dict) -> dict:
    module, L = m.module._module, cfg.num_hidden_layers  # the plain Flax module: the path is set below
    cache = jnp.zeros((L, B * S, cfg.kv_cache_dim), dtype)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (B, S)), jnp.int32)
    lens = jnp.full((B,), S, jnp.int32)
    slots = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S)

    def step(params, routing, cache, tokens, lens, slots):
        v = {"params": params, "routing": routing}
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        with attention_path(path):
            h, cache = module.apply(v, tokens, ForwardBatch.prefill(pos, lens, slots), cache, method="prefill")
            logits = module.apply(v, h[jnp.arange(B), lens - 1], method="logits")
        return cache, logits

    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(2,)).lower(m.params, m.routing, cache, tokens, lens, slots).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    ts = time_steps(compiled, (m.params, m.routing, tokens, lens, slots), cache, iters, warmup)
    del compiled, cache
    gc.collect()
    med = statistics.median(ts)
    out = {"step_s": med, "min_step_s": min(ts), "tok_per_s": B * S / med, "compile_s": compile_s,
           "temp_bytes": int(getattr(ma, "temp_size_in_bytes", 0) or 0), "peak_bytes_in_use": peak_bytes()}
    t, o = time_attention(a, B, S, path, dtype, iters, warmup)
    out["attention_s"] = L * t
    if outputs:  # the same inputs through the first path timed: the paths must agree
        first, ref = next(iter(outputs.items()))
        out[f"attention_rel_err_vs_{first}"] = rel_err(o, ref)
    else:
        outputs[path] = o
    return out


def run_mixed(m, cfg, lens: list[int], dtype, iters: int, warmup: int) -> dict:
    """Prompts of ``lens`` tokens in one prefill step: packed (one stream, cu_seqlens) and padded
    ([B, next pow2 of the longest]); the same tokens, the last token's logits of each prompt."""
    module, L, B = m.module._module, cfg.num_hidden_layers, len(lens)
    n = sum(lens)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, k) for k in lens]
    T, S = packed_bucket(n), pow2(max(lens), 16)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    layouts = {}
    tokens = np.zeros(T, np.int32)
    tokens[:n] = np.concatenate(prompts)
    pos = np.zeros(T, np.int32)
    pos[:n] = np.concatenate([np.arange(k) for k in lens])
    rows = max(T, B * S)  # cache rows; slot ``rows`` is out of range: padding writes are dropped and
    # padding is not taken for real tokens (ForwardBatch.real_tokens)
    slots = np.full(T, rows, np.int32)
    slots[:n] = np.arange(n)
    layouts["packed"] = (T, (tokens, pos, slots, cu))
    tok2, pos2 = np.zeros((B, S), np.int32), np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()
    slots2 = np.full((B, S), rows, np.int32)
    for b, (p, c0) in enumerate(zip(prompts, cu)):
        tok2[b, :len(p)] = p
        slots2[b, :len(p)] = c0 + np.arange(len(p))
    layouts["padded"] = (B * S, (tok2, pos2, slots2, np.asarray(lens, np.int32)))

    def packed(params, routing, cache, tokens, pos, slots, cu):
        v = {"params": params, "routing": routing}
        h, cache = module.apply(v, tokens, ForwardBatch.prefill(pos, slots=slots, cu_seqlens=cu), cache,
                                 method="prefill")
        return cache, module.apply(v, h[cu[1:] - 1], method="logits")

    def padded(params, routing, cache, tokens, pos, slots, seq_lens):
        v = {"params": params, "routing": routing}
        h, cache = module.apply(v, tokens, ForwardBatch.prefill(pos, seq_lens, slots), cache, method="prefill")
        return cache, module.apply(v, h[jnp.arange(B), seq_lens - 1], method="logits")

    out, logits = {"lens": lens, "tokens": n}, {}
    for name, fn in (("packed", packed), ("padded", padded)):
        computed, args = layouts[name]
        cache = jnp.zeros((L, rows, cfg.kv_cache_dim), dtype)
        args = [jnp.asarray(x) for x in args]
        step = jax.jit(fn, donate_argnums=(2,))
        ts = time_steps(step, (m.params, m.routing, *args), cache, iters, warmup)
        med = statistics.median(ts)
        logits[name] = step(m.params, m.routing, jnp.zeros_like(cache), *args)[1]
        out[name] = {"step_s": med, "tokens_computed": computed, "useful_tok_per_s": n / med}
        del cache, step
        gc.collect()
    out["packed_speedup"] = out["padded"]["step_s"] / out["packed"]["step_s"]
    out["logits_rel_err"] = rel_err(logits["packed"], logits["padded"])
    return out


def bench_preset(name: str, a_args, rate: float, results: dict, save) -> None:
    hf = bench_hf_config(name, a_args.layers)
    cfg = parse_model_config(hf)
    dtype = jnp.dtype(a_args.dtype)
    for wd in a_args.weight_dtype.split(","):
        bench_weights(name, hf, cfg, dtype, wd, a_args, rate, results, save)


def bench_weights(name, hf, cfg, dtype, wd: str, a_args, rate: float, results: dict, save) -> None:
    """Every point and path of one preset with one weight format (``wd``: a --weight-dtype item)."""
    t0 = time.perf_counter()
    wkw = weight_kw(wd)
    fp8 = EngineConfig.create(cfg, **wkw).fp8
    if a_args.smoke and wd == "bf16":  # NumPy weights: no per-leaf compilation on the CPU
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), random_params(cfg))
    else:
        params = random_device_params(abstract_params(cfg, a_args.dtype, fp8))
    m = random_model(hf, params=params, kernels="xla", max_model_len=min(cfg.max_position_embeddings, 4096),
                     **engine_settings(a_args), **wkw)
    a = attention_shapes(cfg)
    print(f"\n{name}: {cfg.num_hidden_layers} layers, {a['H']} heads over {a['Hk']} K/V heads, "
          f"qk {a['Dk']}+{a['R']}, v {a['Dv']}, {wd} weights (made in {time.perf_counter() - t0:.0f} s)")
    res = results["presets"].setdefault(name, {"layers": cfg.num_hidden_layers, "attention": a, "points": {}})
    tag = "" if wd == "bf16" else f"+{wd}"
    for spec in filter(None, (a_args.mixed or "").split("/")):
        lens = [int(x) for x in spec.split(",")]
        try:
            with kernel_mode("auto"):
                r = run_mixed(m, cfg, lens, dtype, a_args.iters, a_args.warmup)
        except Exception as e:  # noqa: BLE001  (record it, go on with the points)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            traceback.print_exc()
            res.setdefault("mixed", {})[spec + tag] = {"failed": why}
            print(f"  mixed {spec}{tag}: failed: {why}")
            gc.collect()
            save()
            continue
        res.setdefault("mixed", {})[spec + tag] = r
        pk, pd = r["packed"], r["padded"]
        print(f"  mixed {spec}{tag}: packed {pk['step_s'] * 1e3:.2f} ms ({pk['tokens_computed']} tokens computed, "
              f"{pk['useful_tok_per_s']:.0f} tok/s) vs padded {pd['step_s'] * 1e3:.2f} ms "
              f"({pd['tokens_computed']} tokens, {pd['useful_tok_per_s']:.0f} tok/s): x{r['packed_speedup']:.2f}, "
              f"logits rel err {r['logits_rel_err']:.1e}")
        sys.stdout.flush()
        save()
    if a_args.mixed and not a_args.points:
        del m, params
        gc.collect()
        return
    for point in filter(None, a_args.points.split(",")):
        B, S = (int(x) for x in point.lower().split("x"))
        mm, at = step_flops(cfg, B, S)
        floor = (mm + at) / rate
        sel = prefill.plan(B, S, S, a["H"], a["Hk"], a["Dk"], a["R"], a["Dv"], dtype, "auto")
        pr = res["points"].setdefault(point, {"batch": B, "len": S, "matmul_flops": mm, "attention_flops": at,
                                              "floor_s": floor, "auto_selects": [sel.path, sel.params],
                                              "paths": {}})
        outputs: dict = {}
        for path in a_args.kernels.split(","):
            key = path + tag
            scores_gb = 4 * B * a["H"] * S * S / 1e9
            if path == "full" and scores_gb > a_args.full_limit_gb:
                pr["paths"][key] = {"skipped": f"its f32 scores alone are {scores_gb:.0f} GB "
                                                f"(> --full-limit-gb {a_args.full_limit_gb})"}
                print(f"  {point:>8} [{key:>6}]: skipped ({pr['paths'][key]['skipped']})")
                continue
            try:
                r = run_point(m, cfg, B, S, path, a, dtype, a_args.iters, a_args.warmup, outputs)
            except Exception as e:  # noqa: BLE001  (e.g. out of memory: record it, go on)
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                if a_args.smoke:
                    traceback.print_exc()
                pr["paths"][key] = {"failed": why}
                print(f"  {point:>8} [{key:>6}]: failed: {why}")
                gc.collect()
                save()
                continue
            r["floor_fraction"] = floor / r["step_s"]
            pr["paths"][key] = r
            err = "".join(f", err {v:.1e} vs {k[len('attention_rel_err_vs_'):]}" for k, v in r.items()
                          if k.startswith("attention_rel_err_vs_"))
            pk = "" if r["peak_bytes_in_use"] is None else f", peak {r['peak_bytes_in_use'] / 2**30:.1f} GiB"
            print(f"  {point:>8} [{key:>6}]: step {r['step_s'] * 1e3:9.2f} ms, {r['tok_per_s']:9.0f} tok/s, "
                  f"{100 * r['floor_fraction']:5.1f}% of floor {floor * 1e3:.2f} ms; attention "
                  f"{r['attention_s'] * 1e3:8.2f} ms; temps {r['temp_bytes'] / 2**30:.2f} GiB{pk}{err}")
            sys.stdout.flush()
            save()
        outputs.clear()
        for path in a_args.kernels.split(","):
            r = pr["paths"].get(path + tag, {})
            for other in ("xla", "attn-xla", "full"):
                base = pr["paths"].get(other + tag, {})
                if "step_s" in r and "step_s" in base and path != other:
                    r[f"speedup_vs_{other}"] = base["step_s"] / r["step_s"]
                    r[f"attention_speedup_vs_{other}"] = base["attention_s"] / r["attention_s"]
            bf16 = pr["paths"].get(path, {})
            if tag and "step_s" in r and "step_s" in bf16:
                r["speedup_vs_bf16"] = bf16["step_s"] / r["step_s"]
                print(f"  {point:>8} [{path + tag:>6}]: x{r['speedup_vs_bf16']:.2f} vs bf16 weights")
    del m, params
    gc.collect()


# ------------------------------------------------------------------ correctness on the device
def reference64(q, kv, n: int, ctx: int, scale: float, a: dict, qr=None, kr=None, rows=None):
    """float64 NumPy attention of query rows ``rows`` (the last n positions of a ctx-token context)."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    g = a["H"] // a["Hk"]
    out = {}
    for i in rows:
        pos = ctx - n + i
        for h in range(a["H"]):
            kh = h // g
            s = kv[:pos + 1, kh, :a["Dk"]] @ q[i, h]
            if qr is not None:
                s = s + np.asarray(kr[:pos + 1], np.float64) @ np.asarray(qr[i, h], np.float64)
            s = s * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ kv[:pos + 1, kh, a["Dk"]:a["Dk"] + a["Dv"]] / p.sum()
    return out


def check(a_args) -> dict:
    """The kernel as compiled for this device (bf16 operands, selected block sizes) against float64
    NumPy attention on sampled rows, at MLA and MFA shapes, one-shot and as a chunk of a longer
    context; and against the XLA blocked path on every row."""
    cases = {"mla": dict(H=128, Hk=128, Dk=128, R=64, Dv=128, W=256, scale=0.1),
             "mfa": dict(H=64, Hk=1, Dk=256, R=0, Dv=256, W=512, scale=0.0625)}
    sizes = ((1000, 1000), (333, 1500))
    if a_args.smoke:  # the interpreter on the CPU: small shapes
        cases = {"mla": dict(H=4, Hk=4, Dk=32, R=16, Dv=16, W=48, scale=0.1),
                 "mfa": dict(H=8, Hk=1, Dk=32, R=0, Dv=32, W=64, scale=0.1)}
        sizes = ((120, 120), (103, 150))
    res = {}
    for name, a in cases.items():
        for n, ctx in sizes:  # lengths not dividing the blocks; a chunk after 1167
            B = 2
            q, kv, qr, kr, _ = attention_inputs(a, B, ctx, BF16)
            q, qr = q[:, -n:], (None if qr is None else qr[:, -n:])
            lens = jnp.asarray([n, n - 100], jnp.int32)
            ctxs = jnp.asarray([ctx, ctx - 100], jnp.int32)  # sequence 1: a shorter context, ragged
            kw = dict(scale=a["scale"], v_offset=a["Dk"], v_dim=a["Dv"])

            def attn(q, kv, qr, kr, lens, ctxs, kw=kw):  # arrays as arguments (not folded constants)
                return prefill_attention(q, kv, lens, ctxs, q_rope=qr, k_rope=kr, **kw)

            with kernel_mode("pallas"):  # one function object per mode: jit's trace cache ignores the mode
                got = jax.jit(lambda *x: attn(*x))(q, kv, qr, kr, lens, ctxs)
            with kernel_mode("xla"):
                xla = jax.jit(lambda *x: attn(*x))(q, kv, qr, kr, lens, ctxs)
            rows = sorted({0, 1, 17, n // 2, n - 101, n - 1})
            ref = reference64(q[0], kv[0], n, ctx, a["scale"], a, None if qr is None else qr[0],
                              None if kr is None else kr[0], rows)
            g = np.asarray(got[0], np.float64)
            err = max(np.abs(g[i, h] - r).max() / (np.abs(r).max() + 1e-6) for (i, h), r in ref.items())
            vs_xla = rel_err(got, xla)
            pad_zero = not bool(jnp.any(got[1, n - 100:] != 0))
            res[f"{name}-{n}of{ctx}"] = {"max_err_vs_float64": float(err), "rel_err_vs_xla": vs_xla,
                                         "padding_rows_zero": pad_zero}
            print(f"check {name} {n} of {ctx}: max err vs float64 {err:.2e}, vs XLA path {vs_xla:.2e}, "
                  f"padding rows zero: {pad_zero}")
            assert err < 3e-2 and vs_xla < 1e-2 and pad_zero, res
    return res


# ------------------------------------------------------------------ kernel block sweep
def sweep(a_args, rate: float, results: dict) -> None:
    """The flash kernel alone at MLA (DeepSeek-V3) and MFA (Step3) shapes, for several block sizes,
    beside the XLA blocked path."""
    cases = {"mla-v3": dict(H=128, Hk=128, Dk=128, R=64, Dv=128, W=256, scale=0.1),
             "mfa-step3": dict(H=64, Hk=1, Dk=256, R=0, Dv=256, W=512, scale=0.0625)}
    grid = [(bq, bk, w, st) for bq in (64, 128) for bk in (32, 64, 128) for w, st in ((4, 2), (8, 2), (8, 3))]
    B, S = (int(x) for x in a_args.sweep_point.split("x"))
    out = results.setdefault("sweep", {})
    for name, a in cases.items():
        q, kv, qr, kr, lens = attention_inputs(a, B, S, BF16)
        flops = B * S * (S + 1) / 2 * a["H"] * 2 * (a["Dk"] + a["R"] + a["Dv"])
        rows = out.setdefault(name, {"point": a_args.sweep_point, "floor_s": flops / rate, "runs": []})
        sel = prefill.plan(B, S, S, a["H"], a["Hk"], a["Dk"], a["R"], a["Dv"], BF16, "pallas").params
        xla = time_call(jax.jit(lambda q, kv, qr, kr, n: prefill.xla(
            q, kv, n, scale=a["scale"], q_rope=qr, k_rope=kr, v_dim=a["Dv"], out_dtype=BF16)), q, kv, qr, kr, lens,
            iters=a_args.iters, warmup=1)
        rows["xla_s"] = xla
        print(f"\nsweep {name} {a_args.sweep_point}: floor {flops / rate * 1e3:.2f} ms, "
              f"XLA blocked {xla * 1e3:.2f} ms; selected {sel}")
        for bq, bk, w, st in grid:
            kw = dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
            try:
                f = jax.jit(lambda q, kv, qr, kr, n, kw=kw: flash_prefill_attention(
                    q, kv, n, scale=a["scale"], q_rope=qr, k_rope=kr, v_dim=a["Dv"], out_dtype=BF16, **kw))
                t = time_call(f, q, kv, qr, kr, lens, iters=a_args.iters, warmup=1)
            except Exception as e:  # noqa: BLE001  (a tile that does not fit: shared memory, registers)
                rows["runs"].append({**kw, "failed": str(e).strip().splitlines()[0][:200]})
                print(f"  {kw}: failed")
                continue
            rows["runs"].append({**kw, "s": t, "floor_fraction": flops / rate / t})
            mark = " <- selected" if kw == {k: sel[k] for k in kw} else ""
            print(f"  bq {bq:3} bk {bk:3} warps {w} stages {st}: {t * 1e3:8.3f} ms, "
                  f"{100 * flops / rate / t:5.1f}% of floor, x{xla / t:.2f} XLA{mark}")
            sys.stdout.flush()
        del q, kv, qr, kr


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3-ep8-rank,deepseek-v2-lite,step3-ep8-rank", help="comma list")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (first layer dense)")
    ap.add_argument("--points", default="1x2048,1x8192,1x32768,8x2048,32x2048", help="BATCHxLENGTH, comma list")
    ap.add_argument("--kernels", default="auto,xla,attn-xla,full", help="comma list of " + " / ".join(PATHS))
    ap.add_argument("--full-limit-gb", type=float, default=24.0,
                    help="skip the full-score path where its f32 scores alone exceed this")
    ap.add_argument("--weight-dtype", default="bf16", help="comma list of bf16 / fp8 / fp8:<layer types joined by +>")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mixed", default="", help="prompt lengths of one packed-vs-padded step, comma list; "
                                                  "several joined by '/'")
    ap.add_argument("--sweep", action="store_true", help="only the kernel block-size sweep (attention alone)")
    ap.add_argument("--sweep-point", default="1x8192")
    ap.add_argument("--check", action="store_true", help="first check the kernel against float64 on this device")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script in seconds")
    ap.add_argument("--json", default=None)
    add_engine_flags(ap)  # --dtype, --fp8-variant, --moe-kernel, --mla-kernel, ... (moejax/engine_args.py)
    a = ap.parse_args(argv)
    if a.smoke:
        a.preset, a.points, a.iters, a.warmup = "v3-tiny,step3-tiny", "2x40", 2, 1
        if a.kernels == ap.get_default("kernels"):
            a.kernels = "pallas,xla,attn-xla,full"
    for k in a.kernels.split(","):
        if k not in PATHS:
            raise SystemExit(f"--kernels: {k!r} is not one of {', '.join(PATHS)}")
    rate = measure_matmul_rate(256 if a.smoke else None)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; measured bf16 matmul {rate / 1e12:.1f} TFLOP/s")
    results = {"device": dev.device_kind, "matmul_rate": rate, "argv": sys.argv[1:] if argv is None else argv,
               "presets": {}}

    def save():
        if a.json:  # after every point: a later failure loses nothing measured
            with open(a.json, "w") as f:
                json.dump(results, f, indent=2)

    if a.check:
        results["check"] = check(a)
        save()
    if a.sweep:
        sweep(a, rate, results)
    else:
        for name in a.preset.split(","):
            bench_preset(name, a, rate, results, save)
    save()
    return results


if __name__ == "__main__":
    main()
