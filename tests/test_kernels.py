"""Pallas kernels (interpret mode on CPU) against plain float32 references, kernel selection,
the FP8 latent cache, Triton lowering (IR only), and the model with kernels on vs the XLA path."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import common, mfa_decode, mla_decode, moe
from moejax.kernels.common import kernel_mode
from moejax.kernels.kv_quant import cache_row_dim, dequantize_rows, quantize_rows
from pallas_kernels import jax_triton_compat
from pallas_kernels.fused_moe import fused_moe
from pallas_kernels.paged_decode_attention import paged_decode_attention

from conftest import prefill_then_decode_logits

BF16 = jnp.bfloat16


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fresh_key_seed():
    """A jax.random key seed drawn from the per-test seed (conftest), so kernel inputs stay fresh and replay."""
    return int(np.random.default_rng().integers(2 ** 31))


# ------------------------------------------------------------------ fused MoE
def moe_reference(x, group_sizes, wg, wu, wd):
    x, wg, wu, wd = (np.asarray(a, np.float32) for a in (x, wg, wu, wd))
    out, s = np.zeros((x.shape[0], wd.shape[-1]), np.float32), 0
    for e, g in enumerate(np.asarray(group_sizes)):
        xe = x[s:s + g]
        a, b = xe @ wg[e], xe @ wu[e]
        out[s:s + g] = (a / (1 + np.exp(-a)) * b) @ wd[e]
        s += g
    return out


def moe_inputs(seed, N, H, I, group_sizes):
    E = len(group_sizes)
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (N, H)).astype(BF16)
    wg = (jax.random.normal(k[1], (E, H, I)) / H ** 0.5).astype(BF16)
    wu = (jax.random.normal(k[2], (E, H, I)) / H ** 0.5).astype(BF16)
    wd = (jax.random.normal(k[3], (E, I, H)) / I ** 0.5).astype(BF16)
    return x, jnp.asarray(group_sizes, jnp.int32), wg, wu, wd


@pytest.mark.parametrize("N,H,I,group_sizes,blocks", [
    (13, 40, 24, [3, 0, 7, 2], (16, 16, 16)),       # odd H and I, an empty expert, 1 garbage row
    (1, 48, 40, [0, 1, 0], (16, 16, 32)),           # one token, empty experts around it
    (70, 64, 96, [0, 33, 0, 20, 17], (32, 32, 32)),  # prefill-like tiles, groups spanning tiles
    (24, 32, 32, [6, 6, 6, 6], (16, 32, 32)),       # all aligned (slice fast path)
])
def test_fused_moe_matches_reference(N, H, I, group_sizes, blocks):
    """fused_moe against a float32 NumPy per-expert SwiGLU on the same bf16 inputs: rel 1e-2 on the
    grouped rows; rows past the groups are exactly zero."""
    x, gs, wg, wu, wd = moe_inputs(fresh_key_seed(), N, H, I, group_sizes)
    bm, bn, bk = blocks
    y = fused_moe(x, gs, wg, wu, wd, block_m=bm, block_n=bn, block_k=bk, block_n_down=bn, block_k_down=bk,
                  interpret=True)
    n = int(sum(group_sizes))
    assert y.shape == (N, H) and y.dtype == jnp.float32
    assert rel_err(y[:n], moe_reference(x, gs, wg, wu, wd)[:n]) < 1e-2
    assert not np.any(np.asarray(y[n:]))  # rows outside the groups come back as zeros


def test_grouped_expert_mlp_selects_pallas_when_forced():
    """The model's grouped_expert_mlp with kernels forced to Pallas against its XLA path: rel 1e-2."""
    from moejax.layers.experts import ExpertWeights, grouped_expert_mlp
    x, gs, wg, wu, wd = moe_inputs(fresh_key_seed(), 20, 32, 48, [5, 0, 9, 4])
    with kernel_mode("xla"):
        ref = grouped_expert_mlp(x, gs, ExpertWeights(wg, wu, wd))
    with kernel_mode("pallas"):
        got = jax.jit(lambda *a: grouped_expert_mlp(a[0], a[1], ExpertWeights(*a[2:])))(x, gs, wg, wu, wd)
    assert rel_err(got[:18], ref[:18]) < 1e-2


# ------------------------------------------------------------------ MLA decode
def mla_reference(ql, qr, values, block_tables, seq_lens, block_size, scale):
    """values [num_slots, C+R] float32 (the cache contents, already dequantised)."""
    ql, qr, values = (np.asarray(a, np.float64) for a in (ql, qr, values))
    C = ql.shape[-1]
    out = np.zeros(ql.shape, np.float64)
    for b, n in enumerate(np.asarray(seq_lens)):
        t = np.arange(n)
        kv = values[np.asarray(block_tables)[b, t // block_size] * block_size + t % block_size]
        s = (ql[b] @ kv[:, :C].T + qr[b] @ kv[:, C:].T) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = (p / p.sum(-1, keepdims=True)) @ kv[:, :C]
    return out


def stored_cache(values, kv: str, width: int):
    """(cache, what its layer 1 holds as float32) for values [L, slots, width]: bf16 rows or kv_quant FP8 rows."""
    if kv == "bf16":
        cache = values.astype(BF16)
        return cache, cache[1].astype(jnp.float32)
    cache = quantize_rows(values, cache_row_dim(width, "fp8"))
    return cache, dequantize_rows(cache[1], width)


def mla_inputs(seed, B, H, C, R, block_size, nb, L=2):
    k = jax.random.split(jax.random.key(seed), 4)
    num_slots = B * nb * block_size + block_size
    values = jax.random.normal(k[0], (L, num_slots, C + R))
    ql = jax.random.normal(k[1], (B, H, C)).astype(BF16)
    qr = jax.random.normal(k[2], (B, H, R)).astype(BF16)
    pages = jax.random.permutation(k[3], num_slots // block_size)[:B * nb]
    return values, ql, qr, pages.reshape(B, nb).astype(jnp.int32)


@pytest.mark.parametrize("tile", ["gather", "pages"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("B,H,C,R,block_size,nb,lens,block_h,block_t,splits", [
    (4, 16, 64, 16, 4, 12, [1, 5, 48, 23], 16, 8, 1),    # mixed short / long, one split
    (3, 12, 32, 16, 8, 8, [64, 1, 37], 8, 16, 3),       # heads not a multiple of the head block, 3 splits
    (2, 16, 64, 32, 16, 4, [2, 64], 16, 16, 4),         # a split left empty for the short sequence
    (3, 16, 64, 16, 4, 10, [40, 29, 17], 16, 12, 2),     # 3 pages a tile; last tile runs past the table
])
def test_mla_decode_matches_reference(kv, B, H, C, R, block_size, nb, lens, block_h, block_t, splits, tile):
    """Paged MLA decode kernel against float64 NumPy attention over what the cache holds (rel 1e-2);
    with FP8, also against the unquantised values (3e-2, or the format's own error on the draw)."""
    values, ql, qr, bt = mla_inputs(fresh_key_seed(), B, H, C, R, block_size, nb)
    lens = jnp.asarray(lens, jnp.int32)
    scale = 0.3 / (C + R) ** 0.5 * 4
    cache, stored = stored_cache(values, kv, C + R)
    got = paged_decode_attention(ql, qr, cache, bt, lens, block_size=block_size, scale=scale, layer=1, block_h=block_h,
                            block_t=block_t, num_splits=splits, tile=tile, interpret=True)
    assert got.shape == (B, H, C) and got.dtype == jnp.float32
    # against the exact attention over what the cache holds
    exact = mla_reference(ql, qr, stored, bt, lens, block_size, scale)
    assert rel_err(got, exact) < 1e-2
    if tile == "gather" and kv == "bf16":  # a bf16 context: written by the kernel (one split) or after the combine
        gb = paged_decode_attention(ql, qr, cache, bt, lens, block_size=block_size, scale=scale, layer=1,
                                    block_h=block_h, block_t=block_t, num_splits=splits, tile=tile, out_dtype=BF16,
                                    interpret=True)
        assert gb.dtype == BF16 and rel_err(gb, exact) < 1e-2
    if kv == "fp8":  # and against the unquantised values: 3e-2, or the FP8 format's own error on this draw
        unq = mla_reference(ql, qr, values[1], bt, lens, block_size, scale)
        assert rel_err(got, unq) < max(3e-2, rel_err(exact, unq) + 5e-3)


def mfa_reference(q, values, block_tables, seq_lens, block_size, scale):
    """float64 per-head attention over [k | v] rows (one K/V head)."""
    q, values = np.asarray(q, np.float64), np.asarray(values, np.float64)
    B, H, D = q.shape
    out = np.zeros((B, H, D))
    for b in range(B):
        t = np.arange(int(seq_lens[b]))
        kv = values[np.asarray(block_tables)[b, t // block_size] * block_size + t % block_size]
        s = q[b] @ kv[:, :D].T * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = (p / p.sum(-1, keepdims=True)) @ kv[:, D:]
    return out


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("B,H,D,block_size,nb,lens,block_h,block_t,splits,tile", [
    (3, 16, 64, 4, 10, [40, 1, 17], 16, 8, 1, "pages"),    # mixed lengths, 2 pages a step
    (2, 20, 32, 8, 6, [48, 30], 16, 8, 3, "pages"),        # heads not a multiple of the block, 3 splits
    (3, 16, 64, 4, 10, [40, 1, 17], 16, 16, 2, "gather"),  # tokens of 4 pages in one tile
])
def test_mfa_decode_kernel_matches_reference(kv, B, H, D, block_size, nb, lens, block_h, block_t, splits, tile):
    """Step3 MFA through the MLA kernel (either tile: scores on columns [0, D), values on [D, 2D))
    against float64 NumPy per-head attention (rel 1e-2; FP8 also against the unquantised values),
    and the model's entry point forced to the kernel against its XLA path."""
    k = jax.random.split(jax.random.key(fresh_key_seed()), 3)
    L, num_slots = 2, B * nb * block_size + block_size
    values = jax.random.normal(k[0], (L, num_slots, 2 * D))
    q = jax.random.normal(k[1], (B, H, D)).astype(BF16)
    bt = jax.random.permutation(k[2], num_slots // block_size)[:B * nb].reshape(B, nb).astype(jnp.int32)
    lens = jnp.asarray(lens, jnp.int32)
    scale = D ** -0.5
    if kv == "bf16":
        cache = values.astype(BF16)
        stored = cache[1].astype(jnp.float32)
    else:
        cache = quantize_rows(values, cache_row_dim(2 * D, "fp8"))
        stored = dequantize_rows(cache[1], 2 * D)
    got = paged_decode_attention(q, None, cache, bt, lens, block_size=block_size, scale=scale, layer=1, v_offset=D,
                            block_h=block_h, block_t=block_t, num_splits=splits, tile=tile, interpret=True)
    assert got.shape == (B, H, D)
    exact = mfa_reference(q, stored, bt, lens, block_size, scale)
    assert rel_err(got, exact) < 1e-2
    if kv == "fp8":
        unq = mfa_reference(q, values[1], bt, lens, block_size, scale)
        assert rel_err(got, unq) < max(3e-2, rel_err(exact, unq) + 5e-3)
    # the model's entry point: the XLA path (auto on CPU) and the forced kernel agree
    from moejax.layers.paged_attention import mfa_decode_attention
    fn = functools.partial(mfa_decode_attention, block_size=block_size, scale=scale, num_kv_heads=1, layer=1)
    with kernel_mode("xla"):
        ref = jax.jit(fn)(q, cache, bt, lens)
    with kernel_mode("pallas"):
        forced = jax.jit(fn)(q, cache, bt, lens)
    assert rel_err(forced, ref) < 1e-2 and rel_err(ref, exact) < 1e-2


def test_fp8_selection_on_gpu(monkeypatch):
    """auto on a GPU without jax-triton: an FP8 cache with 64+ heads stays on XLA (the page tile timed
    slower there), 16 heads take the gather tile with 32 tokens (plain FP8 loads; 2026-12-07d); bf16 takes the
    gather tile; "pallas" still forces the kernel."""
    FP8 = jnp.float8_e4m3fn
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    monkeypatch.setattr(jax_triton_compat, "available", lambda: (False, "absent"))
    with kernel_mode("auto"):
        assert mla_decode.plan(256, 128, 512, 64, 2048, 16, FP8).path == "xla"
        assert mfa_decode.plan(256, 64, 256, 1, 4096, 16, FP8).path == "xla"
        c = mla_decode.plan(256, 16, 512, 64, 2048, 16, FP8)
        assert c.path == "pallas" and (c.params["tile"], c.params["block_t"], c.params["num_stages"]) == ("gather", 32, 2)
        assert mla_decode.plan(256, 128, 512, 64, 2048, 16, BF16).params["tile"] == "gather"
        # with jax-triton: the Triton kernel over an FP8 cache with 64+ heads (CUDA only; XLA before), the
        # Pallas kernels otherwise (bf16 caches and 16 heads over FP8: Pallas' gather tile timed faster)
        monkeypatch.setattr(jax_triton_compat, "available", lambda: (True, ""))
        c = mla_decode.plan(512, 128, 512, 64, 2048, 16, FP8)
        assert c.path == "triton" and c.params["block_h"] == 64 and c.params["num_splits"] == 1
        assert c.params["num_stages"] == 1  # FP8 rows widened in registers: one stage timed faster
        assert mla_decode.plan(8, 128, 512, 64, 2048, 16, FP8).params["num_splits"] > 1  # splits fill the GPU
        c = mla_decode.plan(256, 16, 512, 64, 2048, 16, FP8)
        assert c.path == "pallas" and c.params["tile"] == "gather"
        c = mla_decode.plan(256, 16, 512, 64, 2048, 16, FP8, rows=4)  # the verify's rows together: Triton
        assert c.path == "triton" and c.params["rows"] == 4
        assert mla_decode.plan(512, 128, 512, 64, 2048, 16, BF16).params["tile"] == "gather"
        monkeypatch.setenv(common.MLA_KERNEL_ENV, "pallas")
        assert mla_decode.plan(512, 128, 512, 64, 2048, 16, FP8).path == "xla"
        monkeypatch.setenv(common.MLA_KERNEL_ENV, "triton")
        assert mla_decode.plan(512, 128, 512, 64, 2048, 16, BF16).path == "triton"
        monkeypatch.setenv(common.MLA_KERNEL_ENV, "flash")
        with pytest.raises(ValueError, match=common.MLA_KERNEL_ENV):
            mla_decode.plan(512, 128, 512, 64, 2048, 16, BF16)
        monkeypatch.delenv(common.MLA_KERNEL_ENV)
        monkeypatch.setattr(common, "platform", lambda: "rocm")
        assert mla_decode.plan(512, 128, 512, 64, 2048, 16, FP8).path == "xla"  # 64 KB of LDS: no Triton kernel
        monkeypatch.setattr(common, "platform", lambda: "cuda")
    monkeypatch.setattr(jax_triton_compat, "available", lambda: (False, "absent"))
    with kernel_mode("pallas"):
        assert mla_decode.plan(256, 128, 512, 64, 2048, 16, FP8).params["tile"] == "pages"


def test_mfa_selection(monkeypatch):
    """select_mfa's choices against the timed table: XLA on CPU, the gather tile with its block sizes
    and stages per GPU and batch, XLA for grouped K/V heads or non-power-of-two head_dim; a bad tile named."""
    with kernel_mode("auto"):
        assert mfa_decode.plan(32, 64, 256, 1, 4096, 16, BF16).path == "xla"  # CPU
        for gpu in ("cuda", "rocm"):  # a GPU: the gather tile (timed faster than XLA on the H200)
            monkeypatch.setattr(common, "platform", lambda gpu=gpu: gpu)
            c = mfa_decode.plan(32, 64, 256, 1, 4096, 16, BF16)
            assert c.path == "pallas" and c.reason == "gpu" and c.params["tile"] == "gather"
            # batch 32: too few sequences for 32-head programs
            assert (c.params["block_h"], c.params["block_t"]) == (16, 32)
            assert c.params["num_stages"] == (1 if gpu == "rocm" else 2)
            for batch in (64, 256):  # 32 heads x 64 tokens from half a program per SM up
                big = mfa_decode.plan(batch, 64, 256, 1, 4096, 16, BF16).params
                want = (16, 32, 1) if gpu == "rocm" else (32, 64, 3)
                assert (big["block_h"], big["block_t"], big["num_stages"]) == want
            assert mfa_decode.plan(32, 64, 96, 1, 4096, 16, BF16).path == "xla"  # head_dim not a power of two
        monkeypatch.undo()
    with kernel_mode("pallas"):
        c = mfa_decode.plan(32, 64, 256, 1, 4096, 16, BF16)
        assert c.path == "pallas" and c.params["tile"] == "gather"
        assert mfa_decode.plan(32, 64, 256, 2, 4096, 16, BF16).path == "xla"  # grouped K/V heads: XLA
    with pytest.raises(ValueError, match="tile must be"):
        paged_decode_attention(jnp.zeros((1, 16, 16), BF16), None, jnp.zeros((32, 32), BF16), jnp.zeros((1, 2), jnp.int32),
                          jnp.ones((1,), jnp.int32), block_size=16, scale=1.0, tile="rows")


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_xla_path_reads_fp8_cache_and_matches_pallas(kv):
    """The model's MLA decode forced to Pallas against its XLA path over the same (bf16 or FP8)
    cache (rel 1e-2), and the XLA path against float64 attention over the unquantised values."""
    from moejax.layers.paged_attention import mla_decode_attention
    B, H, C, R, bs, nb = 3, 16, 32, 16, 4, 6
    # A fixed draw: the FP8 error against the unquantised values depends on it (up to ~4e-2 over
    # 200 draws), and the 3e-2 bound below holds for this one.
    values, ql, qr, bt = mla_inputs(5, B, H, C, R, bs, nb)
    lens = jnp.asarray([3, 24, 11], jnp.int32)
    cache = values.astype(BF16) if kv == "auto" else quantize_rows(values, cache_row_dim(C + R, "fp8"))
    fn = functools.partial(mla_decode_attention, block_size=bs, scale=0.1, layer=1)
    with kernel_mode("xla"):
        ref = jax.jit(fn)(ql, qr, cache, bt, lens)
    with kernel_mode("pallas"):
        got = jax.jit(fn)(ql, qr, cache, bt, lens)
    assert rel_err(got, ref) < 1e-2
    assert rel_err(ref, mla_reference(ql, qr, values[1], bt, lens, bs, 0.1)) < (1e-2 if kv == "auto" else 3e-2)


# ------------------------------------------------------------------ FP8 rows
def test_fp8_rows_layout_and_roundtrip():
    """FP8 cache rows: 576 values + scales in 592 e4m3 bytes; the round trip within e4m3's error
    (rel 0.04 per row over six decades of scale), zeros stay exact, stored values within +-448."""
    x = jax.random.normal(jax.random.key(fresh_key_seed()), (6, 576)) * jnp.array([1e-4, 1e-2, 1, 30, 1e3, 0])[:, None]
    rows = quantize_rows(x, cache_row_dim(576, "fp8"))
    assert rows.shape == (6, 592) and rows.dtype == jnp.float8_e4m3fn
    back = dequantize_rows(rows, 576)
    for i in range(5):
        assert rel_err(back[i], x[i]) < 0.04  # e4m3: 3 mantissa bits, ~2.6% rms
    assert not np.any(np.asarray(back[5]))
    assert float(jnp.max(jnp.abs(rows[:, :576].astype(jnp.float32)))) <= 448.0
    with pytest.raises(ValueError):
        cache_row_dim(576, "int8")


# ------------------------------------------------------------------ selection
def test_selection():
    """select_moe / select_mla against the timed table: XLA on CPU under auto, the Pallas block sizes,
    splits and tiles per batch and cache dtype when forced; an unknown mode refused."""
    with kernel_mode("auto"):  # CPU: XLA
        assert moe.plan(256, 32, 7168, 2048, BF16).path == "xla"
        assert mla_decode.plan(64, 128, 512, 64, 2048, 16, BF16).path == "xla"
    with kernel_mode("xla"):
        assert moe.plan(256, 32, 7168, 2048, BF16).path == "xla"
    with kernel_mode("pallas"):
        decode = moe.plan(256, 32, 7168, 2048, BF16)
        prefill = moe.plan(65536, 32, 7168, 2048, BF16)
        assert decode.path == prefill.path == "pallas"
        assert decode.params["block_m"] == 16 and prefill.params["block_m"] == 128
        assert "num_warps" in decode.params and "num_stages" in decode.params
        mla = mla_decode.plan(1, 128, 512, 64, 4096, 16, BF16)
        assert mla.path == "pallas" and mla.params["num_splits"] > 1  # one sequence: split the context
        assert mla_decode.plan(256, 128, 512, 64, 2048, 16, BF16).params["num_splits"] == 1
        # bf16 cache: 64-token gather tiles, 32-head blocks from 32 heads; FP8: whole pages, 16 heads
        p = mla_decode.plan(256, 128, 512, 64, 2048, 16, BF16).params
        assert (p["tile"], p["block_t"], p["block_h"]) == ("gather", 64, 32)
        assert mla_decode.plan(256, 16, 512, 64, 2048, 16, BF16).params["block_h"] == 16
        p = mla_decode.plan(256, 128, 512, 64, 2048, 16, jnp.float8_e4m3fn).params
        assert (p["tile"], p["block_h"]) == ("pages", 16)
    with pytest.raises(ValueError):
        moe.plan(1, 1, 16, 16, BF16, mode="triton")


# ---------------------------------------------------------- Triton lowering (IR only)
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernels_lower_to_triton(platform):
    """Pallas -> Triton IR at DeepSeek-V3 shapes (not compiled to PTX/HSACO: no GPU here)."""
    S = jax.ShapeDtypeStruct
    E, H, I = 32, 7168, 2048
    for N in (256, 8192):
        with kernel_mode("pallas"):
            p = moe.plan(N, E, H, I, BF16).params
        f = functools.partial(fused_moe, **p, interpret=False)
        text = jax.jit(f).trace(S((N, H), BF16), S((E,), jnp.int32), S((E, H, I), BF16), S((E, H, I), BF16),
                                S((E, I, H), BF16)).lower(lowering_platforms=(platform,)).as_text()
        assert text.count("xla.gpu.triton") == 2
    f = functools.partial(fused_moe, interpret=False)  # odd sizes
    text = jax.jit(f).trace(S((13, 40), BF16), S((4,), jnp.int32), S((4, 40, 24), BF16), S((4, 40, 24), BF16),
                            S((4, 24, 40), BF16)).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("xla.gpu.triton") == 2
    B, NH, C, R, bs, nb = 64, 128, 512, 64, 16, 128
    for (dt, D), tile in itertools.product(((BF16, 576), (jnp.float8_e4m3fn, 592)), ("gather", "pages")):
        f = functools.partial(paged_decode_attention, block_size=bs, scale=0.1, layer=3, num_splits=4, tile=tile,
                              block_h=64 if tile == "pages" else 16, interpret=False)
        text = jax.jit(f).trace(S((B, NH, C), BF16), S((B, NH, R), BF16), S((4, 8192, D), dt), S((B, nb), jnp.int32),
                                S((B,), jnp.int32)).lower(lowering_platforms=(platform,)).as_text()
        assert text.count("xla.gpu.triton") == 1
    # Step3 MFA: no rope part, values at column 256 (the gather tile's masked gathers are GPU-only:
    # the interpreter on CPU selects after the load instead, so only this lowering checks them)
    for tile, extra in (("pages", {}), ("gather", dict(block_h=32, block_t=64))):
        text = jax.jit(lambda q, c, t, l: paged_decode_attention(
            q, None, c, t, l, block_size=bs, scale=0.1, layer=1, v_offset=256, tile=tile, interpret=False,
            **extra)).trace(S((B, 64, 256), BF16), S((2, 8192, 512), BF16), S((B, nb), jnp.int32), S((B,), jnp.int32)
                            ).lower(lowering_platforms=(platform,)).as_text()
        assert text.count("xla.gpu.triton") == 1


# ------------------------------------------------------------------ the model
@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from moejax.tiny.checkpoint import make_random_checkpoint
    from moejax.tiny.presets import preset
    d = str(tmp_path_factory.mktemp("tiny_kernels"))
    # Every token goes to all 16 experts: the top-k choice has no discontinuity, so the kernels'
    # rounding cannot flip a routing decision (which moves logits by ~10% in a tiny model).
    return make_random_checkpoint(d, preset("v3-tiny", num_experts_per_tok=16, n_group=1, topk_group=1),
                                  seed=3, std=0.05)


def _prefill_then_decode(path, kernels, kv_cache_dtype):
    """Logits of the last prompt token (prefill) and of one decode step, three sequences."""
    import moejax
    from moejax.kernels.kv_quant import cache_storage_dtype, stored_row_dim
    bs, nb = 8, 4
    m = moejax.load(path, dtype="bfloat16", max_model_len=64, max_num_seqs=4, block_size=bs, num_kv_blocks=16,
                    progress=False, kernels=kernels, kv_cache_dtype=kv_cache_dtype)
    cfg = m.config.model
    dt = cache_storage_dtype(kv_cache_dtype, "bfloat16")
    cache = jnp.zeros((cfg.num_hidden_layers, 16 * bs, stored_row_dim(cfg.kv_cache_dim, dt)), dt)
    # Fixed tokens (seed 0): every call of one test (Pallas, XLA, FP8) must see the same ones, and the fixed
    # 3e-2 FP8-vs-bf16 bound of test_model_logits_pallas_vs_xla is known to hold for this draw.
    return prefill_then_decode_logits(m, cache, np.array([3, 9, 21]), 24, bs, nb, reverse_tables=True,
                                      last_only=True)


def test_model_logits_pallas_vs_xla(tiny_bf16):
    """Prefill and decode logits of the bf16 model with kernels forced to Pallas against the XLA path
    (rel 1e-2; FP8 cache decode 3e-2 against the bf16 cache, 1e-2 against XLA over the same FP8 cache)."""
    pre_x, dec_x = _prefill_then_decode(tiny_bf16, "xla", "auto")
    pre_p, dec_p = _prefill_then_decode(tiny_bf16, "pallas", "auto")
    assert rel_err(pre_p, pre_x) < 1e-2 and rel_err(dec_p, dec_x) < 1e-2
    pre_f, dec_f = _prefill_then_decode(tiny_bf16, "pallas", "fp8")
    assert rel_err(pre_f, pre_x) < 1e-2  # prefill attends to its own latents: the cache is only written
    assert rel_err(dec_f, dec_x) < 3e-2
    pre_fx, dec_fx = _prefill_then_decode(tiny_bf16, "xla", "fp8")
    assert rel_err(dec_f, dec_fx) < 1e-2  # the same FP8 cache through both paths


def test_engine_runs_with_fp8_cache_and_kernels(tiny_bf16):
    """The engine over an FP8 cache (e4m3 rows of 64) with kernels forced to Pallas: the greedy tokens
    and logprobs (atol 1e-2) of the XLA path over the same FP8 cache; bad kernels / cache dtypes named."""
    import moejax
    from moejax.engine.sampling_params import SamplingParams
    kw = dict(dtype="bfloat16", max_model_len=64, max_num_seqs=2, block_size=8, num_kv_blocks=16, progress=False,
              kv_cache_dtype="fp8")
    m = moejax.load(tiny_bf16, kernels="pallas", **kw)
    assert m.engine.runner.cache.dtype == jnp.float8_e4m3fn and m.engine.runner.cache.shape[-1] == 64
    seq = m.engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=True))
    while not seq.is_finished:
        m.engine.step()
    assert seq.num_output_tokens == 3
    # fixed prompt: its top-2 logit gaps (>= 0.06) are far above the paths' difference (~4e-3 in logprob)
    want = moejax.generate(moejax.load(tiny_bf16, kernels="xla", **kw), [[5, 6, 7, 8]], max_new_tokens=3,
                           ignore_eos=True, logprobs=True)[0]
    assert seq.output_ids == want.token_ids
    np.testing.assert_allclose(seq.logprobs, want.logprobs, atol=1e-2)
    with pytest.raises(ValueError):
        moejax.load(tiny_bf16, kernels="cuda", progress=False)
    with pytest.raises(ValueError):
        moejax.load(tiny_bf16, kv_cache_dtype="int8", progress=False)


def test_fp8_cache_rows_padded_for_the_mosaic_gpu_kernel(tiny_bf16, monkeypatch):
    """decode_tables.cache_row_dim: kv_quant's row, or whole 128-byte tiles where MLA decode over FP8 runs the
    Mosaic GPU kernel; an engine over rows padded so serves the same greedy tokens and logprobs (every reader
    takes the values and scale at their columns), through the XLA path and the Pallas kernels alike."""
    import moejax
    from moejax.kernels import decode_tables
    from moejax.kernels.common import Plan
    from moejax.models.registry import parse_model_config
    from moejax.tiny.presets import preset
    cfg = parse_model_config(preset("deepseek-v3"))
    assert decode_tables.cache_row_dim(cfg, "fp8") == 592 and decode_tables.cache_row_dim(cfg, "auto") == 576
    real_plan = mla_decode.plan
    monkeypatch.setattr(mla_decode, "plan", lambda *a, **k: Plan("mgpu") if jnp.dtype(a[6]) == jnp.dtype(
        jnp.float8_e4m3fn) else real_plan(*a, **k))
    assert decode_tables.cache_row_dim(cfg, "fp8") == 640 and decode_tables.cache_row_dim(cfg, "auto") == 576
    monkeypatch.setattr(mla_decode, "plan", real_plan)

    def run(kernels, padded):
        if padded:
            monkeypatch.setattr(decode_tables, "cache_row_dim", lambda c, dt, mode="auto": 128 if dt == "fp8" else
                                c.kv_cache_dim)
        m = moejax.load(tiny_bf16, kernels=kernels, dtype="bfloat16", max_model_len=64, max_num_seqs=2,
                        block_size=8, num_kv_blocks=16, progress=False, kv_cache_dtype="fp8")
        assert m.engine.runner.cache.shape[-1] == (128 if padded else 64)  # (the engine is made when first asked)
        monkeypatch.undo()
        out = moejax.generate(m, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4]], max_new_tokens=4, ignore_eos=True,
                              logprobs=True)
        return [(o.token_ids, o.logprobs) for o in out]

    for kernels in ("xla", "pallas"):
        want, got = run(kernels, False), run(kernels, True)
        for (wt, wl), (gt, gl) in zip(want, got):
            assert gt == wt
            np.testing.assert_allclose(gl, wl, atol=1e-5)


def test_bench_kernels_script_smoke():
    """scripts/bench_kernels.py --smoke (tiny shapes, interpret mode): a timing script, so the check is
    that every kernel section runs with no config failing and a selected row each."""
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, f"{root}/scripts/bench_kernels.py", "--smoke"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for header in ("fused MoE", "MLA decode", "Step3 MFA"):
        assert header in out.stdout
    assert "failed" not in out.stdout and out.stdout.count("selected") >= 4
