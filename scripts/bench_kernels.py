"""GPU microbenchmark: Pallas kernels vs the XLA path at DeepSeek-V3 / V2-Lite / Step3 decode shapes.

    python scripts/bench_kernels.py                 # every kernel at the issue's shapes, selected block sizes
    python scripts/bench_kernels.py --sweep         # also alternative block sizes (per kernel: --only, --grid)
    python scripts/bench_kernels.py --only moe --tokens 8 64 256 --moe-shapes v3-ep8
    python scripts/bench_kernels.py --smoke         # tiny shapes in interpret mode (checks the script on CPU)

Prints, per case: time of each path, the floor max(bytes / copy bandwidth, FLOPs / matmul rate)
from bandwidth and matmul rate measured on this card first, achieved bandwidth, and ratios.
MoE: one GPU's share of DeepSeek-V3 experts (32 experts, H 7168, I 2048) and DeepSeek-V2-Lite's
64 experts (H 2048, I 1408), 8 / 32 / 128 / 512 tokens per expert, against XLA's ragged_dot and a
padded dense einsum. MLA: 128 and 16 heads, C 512, R 64, block 16, batch 64 and 256, contexts
2048 and 8192, bf16 and FP8 cache. MFA (Step3): 64 heads x 256 against one K/V head, context 4096.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from moejax.benchmark.roofline import measure_copy_bandwidth, measure_matmul_rate, time_call, time_device  # noqa: E402

WALL = SMOKE = False  # set from --wall / --smoke in main
from moejax.kernels import common, mfa_decode, mla_decode, moe, paged_decode  # noqa: E402
from moejax.kernels.common import kernel_mode  # noqa: E402
from moejax.layers.experts import ExpertWeights, grouped_expert_mlp  # noqa: E402
from moejax.kernels.kv_quant import cache_row_dim, quantize_rows  # noqa: E402
from moejax.layers.paged_attention import mfa_decode_attention, mla_decode_attention  # noqa: E402
from pallas_kernels.fused_moe import fused_moe  # noqa: E402
from pallas_kernels.jax_triton_compat import available as triton_available  # noqa: E402
from pallas_kernels.triton_block_fp8 import fused_moe_triton  # noqa: E402
from pallas_kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.mgpu_decode_attention import available as mgpu_available  # noqa: E402
from pallas_kernels.mgpu_decode_attention import fp8_row_dim, mgpu_mfa_decode, mgpu_mla_decode  # noqa: E402
from pallas_kernels.mgpu_decode_attention import heads_a_cta as mgpu_heads_a_cta  # noqa: E402
from pallas_kernels.triton_mla_decode import triton_mla_decode  # noqa: E402

BF16 = jnp.bfloat16


def bench(fn, *args, iters=20, warmup=3):
    """Seconds per call of a jitted fn on the device (roofline.time_device: repetitions inside one
    program, launch latency and host synchronisation excluded); ``--wall`` times each call from the host
    instead (the median, compile excluded), as this script did before 2026-12-07b."""
    if WALL:
        return time_call(fn, *args, iters=iters, warmup=warmup)
    return time_device(fn, *args, reps=(1, 2) if SMOKE else (2, 10))


def measure_card(smoke: bool):
    return (measure_copy_bandwidth(1 << 20), measure_matmul_rate(256)) if smoke else \
        (measure_copy_bandwidth(), measure_matmul_rate())


def floor(nbytes, flops, bw, rate):
    return max(nbytes / bw, flops / rate)


def expand(grid):
    """{"a": [1, 2], "b": [3]} or a list of such dicts -> every combination, as dicts."""
    out = []
    for g in grid if isinstance(grid, list) else [grid]:
        keys = list(g)
        for vals in itertools.product(*(g[k] if isinstance(g[k], list) else [g[k]] for k in keys)):
            out.append(dict(zip(keys, vals)))
    return out


def moe_grid(t):
    """Alternatives timed by --sweep for t tokens per expert: decode sizes stream weights (bigger
    tiles, deeper pipelines keep more bytes in flight); prefill sizes want big row tiles."""
    if t <= 16:
        return {"block_m": [16], "block_n": [64, 128], "block_k": [128, 256], "block_n_down": [64, 128],
                "num_warps": [4], "num_stages": [3, 4]}
    if t <= 64:
        return {"block_m": [16, 32], "block_n": [64, 128], "block_k": [128], "block_n_down": [64, 128],
                "num_warps": [4], "num_stages": [3, 4]}
    return [{"block_m": [64, 128], "block_n": [128, 256], "block_k": [64], "block_n_down": [128, 256],
             "block_k_down": [64], "num_warps": [8], "num_stages": [3]},
            {"block_m": [128], "block_n": [128], "block_k": [32, 64], "block_n_down": [128], "block_k_down": [32, 64],
             "num_warps": [4, 8], "num_stages": [4]}]


# Alternatives timed by --sweep for MLA: the Pallas kernel's gather tile (tokens across pages in one dot)
# and whole-page tile, head blocks of 16 and 32 (64 needs 8 warps for its [64, 512] f32 accumulator),
# pipeline depth, splits; and the Triton kernel ("kernel": "triton", 64-head programs on wgmma).
MLA_GRID = [
    {"kernel": ["triton"], "block_h": [64], "block_n": [32, 64], "num_warps": [8], "num_stages": [2, 3]},
    {"kernel": ["triton"], "block_h": [64], "block_n": [64], "num_warps": [8], "num_stages": [2], "num_splits": [2]},
    {"tile": ["gather"], "block_h": [16, 32], "block_t": [32, 64, 128], "num_warps": [4], "num_stages": [2, 3]},
    {"tile": ["gather"], "block_h": [16], "block_t": [64], "num_warps": [4], "num_stages": [2], "num_splits": [2]},
    {"tile": ["pages"], "block_h": [16], "block_t": [16, 32], "num_warps": [4], "num_stages": [2, 3]},
    {"tile": ["pages"], "block_h": [64], "block_t": [16], "num_warps": [8], "num_stages": [2]},
]


def triton_moe_grid(t):
    """Alternatives timed by --sweep for the Triton-language bf16 fused MoE (fused_moe_triton)."""
    if t <= 16:
        return {"block_m": [16], "block_k": [64, 128], "num_warps": [4, 8], "num_stages": [3, 4]}
    return {"block_m": [64, 128], "block_k": [64], "num_warps": [4, 8], "num_stages": [3, 4]}


MOE_SHAPES = {"v3-ep8": (32, 7168, 2048),    # one EP8 rank's share of DeepSeek-V3: 32 of 256 experts
              "v2-lite": (64, 2048, 1408),   # DeepSeek-V2-Lite: all 64 experts (I not a power of two)
              "step3-ep8": (6, 7168, 5120)}  # one EP8 rank's share of Step3: 6 of 48 experts


def run_moe(tokens, bw, rate, sweep, smoke, interpret, grid=None, shape="v3-ep8"):
    E, H, I = (4, 64, 32) if smoke else MOE_SHAPES[shape]
    k = jax.random.split(jax.random.key(0), 4)
    wg = (jax.random.normal(k[1], (E, H, I)) * 0.02).astype(BF16)
    wu = (jax.random.normal(k[2], (E, H, I)) * 0.02).astype(BF16)
    wd = (jax.random.normal(k[3], (E, I, H)) * 0.02).astype(BF16)
    wbytes = 3 * E * H * I * 2
    print(f"\n== fused MoE ({shape}): E={E} H={H} I={I} bf16 (weights {wbytes / 1e9:.2f} GB) ==")
    print(f"{'tok/exp':>7} {'N':>6} {'floor us':>9} {'xla us':>9} {'dense us':>9} {'pallas us':>9} "
          f"{'xla TB/s':>8} {'pal TB/s':>8} {'xla/pal':>7} {'pal/floor':>9}  params")
    for t in tokens:
        N = E * t
        x = jax.random.normal(k[0], (N, H)).astype(BF16)
        gs = jnp.full((E,), t, jnp.int32)
        nbytes = wbytes + N * H * 2 + N * H * 4
        fl = 2 * N * H * I * 3
        fl_t = floor(nbytes, fl, bw, rate)
        with kernel_mode("xla"):
            t_x = bench(jax.jit(lambda x, gs, g, u, d: grouped_expert_mlp(x, gs, ExpertWeights(g, u, d))), x, gs, wg, wu, wd)
        dense = jax.jit(lambda x, wg, wu, wd: jnp.einsum(
            "eti,eih->eth", (jax.nn.silu(jnp.einsum("eth,ehi->eti", x, wg, preferred_element_type=jnp.float32))
                             * jnp.einsum("eth,ehi->eti", x, wu, preferred_element_type=jnp.float32)).astype(BF16),
            wd, preferred_element_type=jnp.float32))
        t_d = bench(dense, x.reshape(E, t, H), wg, wu, wd)

        def row(t_p, what):  # one kernel configuration's line
            print(f"{t:>7} {N:>6} {fl_t * 1e6:9.1f} {t_x * 1e6:9.1f} {t_d * 1e6:9.1f} {t_p * 1e6:9.1f} "
                  f"{wbytes / t_x / 1e12:8.2f} {wbytes / t_p / 1e12:8.2f} {t_x / t_p:7.2f} {t_p / fl_t:9.2f}  {what}")
        with kernel_mode("pallas"):
            p = moe.pallas_plan(N, E, H, I, BF16).params
        configs = [p] + ([dict(p, **g) for g in expand(grid or moe_grid(t))] if sweep else [])
        for i, c in enumerate(configs):
            f = jax.jit(functools.partial(fused_moe, **c, interpret=interpret))
            try:
                t_p = bench(f, x, gs, wg, wu, wd)
            except Exception as e:  # a config Triton rejects (shared memory, registers)
                print(f"{t:>7} {N:>6}  config {c} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            row(t_p, f"{'selected' if i == 0 else ''} {c}")
        if not (smoke or interpret) and triton_available()[0]:  # the Triton-language kernel ("pal" columns)
            base = moe.triton_params(N, E)
            tri = [base] + ([dict(base, **g) for g in expand(triton_moe_grid(t))] if sweep else [])
            for i, c in enumerate(tri):
                try:
                    t_p = bench(jax.jit(functools.partial(fused_moe_triton, **c)), x, gs, wg, wu, wd)
                except Exception as e:
                    print(f"{t:>7} {N:>6}  triton config {c} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                row(t_p, f"triton{' selected' if i == 0 else ''} {c}")


def run_mla(batches, ctx, bw, rate, sweep, smoke, interpret, heads=(128,), grid=None, kvs=("bf16", "fp8"),
            kvs_sweep=("bf16",)):
    for H in heads:
        run_mla_heads(16 if smoke else H, batches, ctx, bw, rate, sweep, smoke, interpret, grid, kvs, kvs_sweep)


MLA_SCALE = 0.1  # the softmax scale of every MLA point


def mla_points(batches, ctx, bs, C, R, kvs):
    """Each (cache dtype, batch) point with its cache: (kv, B, *mla_cache(...))."""
    for kv in kvs:
        for B in batches:
            yield (kv, B, *mla_cache(B, ctx, bs, C, R, kv))


def mla_cache(B, ctx, bs, C, R, kv):
    """B sequences of ctx tokens in a one-layer paged MLA cache ([1, slots, row], bf16 or FP8 rows) with
    shuffled block tables: (blocks a sequence, the keys left for the queries, cache, block tables)."""
    nb = -(-ctx // bs)
    slots = B * nb * bs
    k = jax.random.split(jax.random.key(B), 4)
    vals = jax.random.normal(k[0], (slots, C + R), BF16)
    cache = (vals if kv == "bf16" else quantize_rows(vals, cache_row_dim(C + R, "fp8")))[None]
    bt = jax.random.permutation(k[1], slots // bs).reshape(B, nb).astype(jnp.int32)
    return nb, k, cache, bt


def run_mla_heads(H, batches, ctx, bw, rate, sweep, smoke, interpret, grid, kvs, kvs_sweep):
    C, R, bs = (64, 16, 16) if smoke else (512, 64, 16)
    print(f"\n== MLA decode: H={H} C={C} R={R} block={bs} context={ctx} ==")
    print(f"{'cache':>5} {'B':>4} {'floor us':>9} {'xla us':>9} {'pallas us':>9} {'xla TB/s':>8} {'pal TB/s':>8} "
          f"{'xla/pal':>7} {'pal/floor':>9}  params")
    for kv, B, nb, k, cache, bt in mla_points(batches, ctx, bs, C, R, kvs):
        lens = jnp.full((B,), ctx, jnp.int32)
        ql = jax.random.normal(k[2], (B, H, C), BF16)
        qr = jax.random.normal(k[3], (B, H, R), BF16)
        row = cache.shape[-1] * cache.dtype.itemsize
        nbytes = B * ctx * row + B * H * (C + R) * 2 + B * H * C * 4
        fl = 2 * B * H * ctx * (2 * C + R)
        fl_t = floor(nbytes, fl, bw, rate)
        with kernel_mode("xla"):
            fx = jax.jit(functools.partial(mla_decode_attention, block_size=bs, scale=MLA_SCALE, layer=0))
            t_x = bench(fx, ql, qr, cache, bt, lens)
        with kernel_mode("pallas"):
            ch = mla_decode.plan(B, H, C, R, nb * bs, bs, cache.dtype)
            base = {"pallas": paged_decode.params(B, H, nb * bs, bs, cache.dtype),
                    "triton": mla_decode.triton_params(B, H, nb * bs, kv == "fp8"),
                    "mgpu": dict(block_t=64, num_stages=2, num_splits=1)}
        sel = dict(ch.params, kernel=ch.path)
        configs = [sel] + ([dict(base[g.get("kernel", "pallas")], **g) for g in expand(grid or MLA_GRID)]
                           if sweep and kv in kvs_sweep else [])
        for i, c in enumerate(configs):
            c = dict(c)
            kname = c.pop("kernel", "pallas")
            fn = {"triton": triton_mla_decode, "mgpu": mgpu_mla_decode}.get(kname, paged_decode_attention)
            f = jax.jit(functools.partial(fn, block_size=bs, scale=MLA_SCALE, layer=0, **c, interpret=interpret))
            rows = cache
            if kname == "mgpu" and kv == "fp8":  # its FP8 rows: kv_quant's, zero-padded to whole 128-byte tiles
                rows = mgpu_fp8_rows(cache, C + R)
            try:
                t_p = bench(f, ql, qr, rows, bt, lens)
            except Exception as e:
                print(f"{kv:>5} {B:>4}  config {c} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            kvb = B * ctx * row
            print(f"{kv:>5} {B:>4} {fl_t * 1e6:9.1f} {t_x * 1e6:9.1f} {t_p * 1e6:9.1f} {kvb / t_x / 1e12:8.2f} "
                  f"{kvb / t_p / 1e12:8.2f} {t_x / t_p:7.2f} {t_p / fl_t:9.2f}  {'selected' if i == 0 else ''} {kname} {c}")


def mgpu_fp8_rows(cache, kv_dim: int):
    """The Mosaic GPU kernel's FP8 rows: kv_quant's, zero-padded to whole 128-byte tiles (fp8_row_dim)."""
    return jnp.pad(cache, ((0, 0), (0, 0), (0, fp8_row_dim(kv_dim) - cache.shape[-1])))


def run_mla_rows(H, batches, ctx, rows, bw, rate, smoke, interpret, kvs):
    """The speculative verify's Q = k + 1 query rows a sequence: the Triton kernel and (on Hopper) the Mosaic
    GPU kernel over the rows together (the context read once) against the selected single-row kernel over
    B x Q rows, each with the sequence's table (each row reads the context), as the verify ran before."""
    C, R, bs = (64, 16, 16) if smoke else (512, 64, 16)
    print(f"\n== MLA decode, query rows a sequence: H={H} C={C} R={R} block={bs} context={ctx} ==")
    mg = mgpu_available()[0] and not interpret and common.hopper()
    print(f"{'cache':>5} {'B':>4} {'Q':>2} {'floor us':>9} {'rows us':>9} {'mgpu rows':>9} {'per-row us':>10} "
          f"{'per-row/rows':>12} {'rows/floor':>10}  per-row kernel  (per-row/rows: the faster rows kernel)")
    for kv, B, nb, k, cache, bt in mla_points(batches, ctx, bs, C, R, kvs):
        for Q in rows:
            lens = ctx - (Q - 1) + jnp.broadcast_to(jnp.arange(Q, dtype=jnp.int32), (B, Q))
            ql = jax.random.normal(k[2], (B, Q, H, C), BF16)
            qr = jax.random.normal(k[3], (B, Q, H, R), BF16)
            row = cache.shape[-1] * cache.dtype.itemsize
            nbytes = B * ctx * row + B * Q * H * (C + R) * 2 + B * Q * H * C * 2
            fl_t = floor(nbytes, 2 * B * Q * H * ctx * (2 * C + R), bw, rate)
            with kernel_mode("pallas"):
                grouped = mla_decode.plan(B, H, C, R, nb * bs, bs, cache.dtype, rows=Q)
                flat = mla_decode.plan(B * Q, H, C, R, nb * bs, bs, cache.dtype)
            tp = {kk: v for kk, v in grouped.params.items() if kk != "rows"}
            if grouped.path != "triton":
                tp = mla_decode.triton_params(B, H * Q, nb * bs, kv == "fp8")
            fg = jax.jit(functools.partial(triton_mla_decode, block_size=bs, scale=MLA_SCALE, layer=0,
                                           out_dtype=BF16, interpret=interpret, **tp))
            t_g = bench(fg, ql, qr, cache, bt, lens)
            padded = mgpu_fp8_rows(cache, C + R) if kv == "fp8" else cache
            t_m = float("nan")
            if mg and H % mgpu_heads_a_cta(Q) == 0:
                fm = jax.jit(functools.partial(mgpu_mla_decode, block_size=bs, scale=MLA_SCALE, layer=0,
                                               out_dtype=BF16, **mla_decode.mgpu_params(B, H, nb * bs, rows=Q)))
                t_m = bench(fm, ql, qr, padded, bt, lens)
            ffn = {"triton": triton_mla_decode, "mgpu": mgpu_mla_decode}.get(flat.path, paged_decode_attention)
            ff = jax.jit(functools.partial(ffn, block_size=bs, scale=MLA_SCALE, layer=0, out_dtype=BF16,
                                           interpret=interpret, **flat.params))
            args = (ql.reshape(B * Q, H, C), qr.reshape(B * Q, H, R), padded if flat.path == "mgpu" else cache,
                    jnp.repeat(bt, Q, axis=0), lens.reshape(-1))
            t_f = bench(ff, *args) if flat.path != "xla" else float("nan")
            best = min(t_g, t_m) if t_m == t_m else t_g
            print(f"{kv:>5} {B:>4} {Q:>2} {fl_t * 1e6:9.1f} {t_g * 1e6:9.1f} {t_m * 1e6:9.1f} {t_f * 1e6:10.1f} "
                  f"{t_f / best:12.2f} {best / fl_t:10.2f}  {flat.path} {flat.params}  rows: {tp}")


MFA_GRID = [{"tile": ["gather"], "block_h": [16, 32], "block_t": [32, 64], "num_warps": [4], "num_stages": [2, 3],
             "num_splits": [1, 2]},
            {"tile": ["pages"], "block_h": [16], "block_t": [32], "num_warps": [4], "num_stages": [2]}]


def run_mfa(batches, ctx, bw, rate, sweep, smoke, interpret, grid=None):
    """Step3 MFA decode attention: 64 query heads against one 256-dim K/V head per token, XLA path
    and the Pallas kernel (values at column 256; a grid entry {"kernel": ["mgpu"], ...}: the Mosaic GPU
    kernel), against the bytes it must read (the batch's
    [k|v] rows, once) and its FLOPs."""
    nh, D, bs = (16, 16, 4) if smoke else (64, 256, 16)
    print(f"\n== Step3 MFA decode attention, {nh} heads x {D}, 1 KV head, context {ctx}, bf16 cache ==")
    print(f"{'B':>4} {'floor us':>9} {'xla us':>9} {'pallas us':>9} {'xla TB/s':>8} {'pal TB/s':>8} {'xla/pal':>7} "
          f"{'pal/floor':>9}  params")
    for B in batches:
        nb = -(-ctx // bs)
        key = jax.random.key(B)
        cache = jax.random.normal(key, (B * nb * bs, 2 * D), jnp.float32).astype(BF16)[None]
        tables = jax.random.permutation(jax.random.fold_in(key, 2), B * nb).reshape(B, nb).astype(jnp.int32)
        q = jax.random.normal(jax.random.fold_in(key, 1), (B, nh, D), jnp.float32).astype(BF16)
        lens = jnp.full((B,), ctx, jnp.int32)
        fn = functools.partial(mfa_decode_attention, block_size=bs, scale=D ** -0.5, num_kv_heads=1, layer=0)
        with kernel_mode("xla"):
            t_x = bench(jax.jit(fn), q, cache, tables, lens)
        nbytes = B * ctx * 2 * D * 2
        fl_t = floor(nbytes, 2 * B * nh * ctx * 2 * D, bw, rate)
        with kernel_mode("pallas"):
            p = mfa_decode.plan(B, nh, D, 1, nb * bs, bs, cache.dtype).params
        configs = [p] + ([dict(p, **g) for g in expand(grid or MFA_GRID)] if sweep else [])
        for i, c in enumerate(configs):
            if c.get("kernel") == "mgpu":  # the Mosaic GPU kernel (grid {"kernel": ["mgpu"], ...}): its own params
                c = {k: v for k, v in c.items() if k in ("kernel", "block_t", "num_stages", "num_splits")}
                kw = dict(block_size=bs, scale=D ** -0.5, layer=0, interpret=interpret,
                          **{k: v for k, v in c.items() if k != "kernel"})
                f = jax.jit(functools.partial(mgpu_mfa_decode, **kw))
            else:
                kw = dict(block_size=bs, scale=D ** -0.5, layer=0, v_offset=D, **c, interpret=interpret)
                f = jax.jit(lambda q, c_, t, l, kw=kw: paged_decode_attention(q, None, c_, t, l, **kw))
            try:
                t_p = bench(f, q, cache, tables, lens)
            except Exception as e:
                print(f"{B:>4}  config {c} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            print(f"{B:>4} {fl_t * 1e6:9.1f} {t_x * 1e6:9.1f} {t_p * 1e6:9.1f} {nbytes / t_x / 1e12:8.2f} "
                  f"{nbytes / t_p / 1e12:8.2f} {t_x / t_p:7.2f} {t_p / fl_t:9.2f}  {'selected' if i == 0 else ''} {c}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("moe", "mla", "mfa"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 512], help="tokens per expert")
    ap.add_argument("--moe-shapes", nargs="+", default=list(MOE_SHAPES), choices=list(MOE_SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[2048, 8192], help="MLA contexts (MFA: 4096)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative block sizes")
    ap.add_argument("--grid", type=json.loads, help="sweep grid for the --only kernel, JSON: {param: [values]}")
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16], help="MLA query heads (128: V3; 16: V2-Lite)")
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=("bf16", "fp8"), help="MLA cache dtypes")
    ap.add_argument("--sweep-kv", nargs="+", default=["bf16"], choices=("bf16", "fp8"),
                    help="MLA cache dtypes --sweep times alternatives for")
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="MLA: also time Q query rows a sequence (the speculative verify's k + 1), e.g. 2 3 4")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode: checks the script on CPU")
    ap.add_argument("--wall", action="store_true",
                    help="time each call from the host (launch latency included) instead of on the device")
    a = ap.parse_args()
    global WALL, SMOKE
    WALL, SMOKE = a.wall, a.smoke
    plat = common.platform()
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({plat}), device {jax.devices()[0].device_kind}")
    if plat == "cpu" and not a.smoke:
        print("Not on a GPU: the Pallas (Triton) kernels only run here in the interpreter, so nothing is timed.\n"
              "Run this on the GPU machine, or pass --smoke to check the script with tiny shapes.")
        return 0
    interpret = plat == "cpu"
    if a.smoke:
        a.tokens, a.batch, a.context, a.moe_shapes, a.heads = [2, 5], [2], [40], a.moe_shapes[:1], [16]
    bw, rate = measure_card(a.smoke)
    print(f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    if a.only in (None, "moe"):
        for shape in a.moe_shapes:
            run_moe(a.tokens, bw, rate, a.sweep, a.smoke, interpret, a.grid if a.only == "moe" else None, shape)
    if a.only in (None, "mla"):
        for ctx in a.context:
            if a.rows:
                for H in a.heads:
                    run_mla_rows(16 if a.smoke else H, a.batch, ctx, a.rows, bw, rate, a.smoke, interpret, a.kv)
                continue
            run_mla(a.batch, ctx, bw, rate, a.sweep, a.smoke, interpret, a.heads, a.grid if a.only == "mla" else None,
                    a.kv, tuple(a.sweep_kv))
    if a.only in (None, "mfa"):
        run_mfa(a.batch, 4096 if not a.smoke else a.context[0], bw, rate, a.sweep, a.smoke, interpret,
                a.grid if a.only == "mfa" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
