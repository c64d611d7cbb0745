"""Absorbed-MLA decode attention over the paged latent cache, written in Triton (through jax-triton).

Same contract and numerics as the Pallas kernel (``paged_decode_attention``: flash-decoding, online
softmax in float32, context splits reduced in JAX), laid out for DeepSeek-V3's 128 heads at large
batches, where decode attention is compute-bound (each cache row meets every head of its sequence):

- one program takes ``BH`` (64) query heads of one sequence, so the tensor-core tile is 64 rows tall
  (Hopper's wgmma shape; Pallas-Triton's 64-head blocks measured slower than its 32-head ones,
  BENCHMARKS.md 2026-12-05d) and each cache tile is read by two programs instead of four;
- each step reads ``BN`` token rows once, [latent | rope] through the block table, and uses the latent
  part for both dots (scores q.k and the context p.v: MLA's value is its latent);
- the softmax runs in base 2 (``exp2`` with log2(e) folded into the scale, as FlashAttention);
- an FP8 cache (``kv_quant`` rows: e4m3 values, a power-of-two scale byte after them) is read as
  bytes (masked loads fill zero), widened to bf16 for the dots, its row scale applied to the scores
  and to the probabilities, as the Pallas kernel does.

Several query rows a sequence (the speculative verify's k + 1 tokens, each attending to its own length):
the program's M rows are (query row, head) pairs, so a sequence's context is read once for all its rows
(at 16 heads x 4 rows the 64-row wgmma tile is full, where one row fills a quarter of it).

The grid is (head blocks, splits, sequences), head blocks fastest so that the programs sharing a
cache tile run together and meet it in L2. Exactness: against float64 NumPy in Triton's interpreter
on CPU and on the device (tests/test_triton_mla_decode.py). ROCm: the same source through jax-triton's
HIP backend; not run here (no AMD GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.jax_triton_compat import jit, triton_call
from pallas_kernels.paged_decode_attention import combine_splits, layered_cache

tl = None  # triton.language, set by jax_triton_compat.Kernel on first launch (Triton may be absent)

LOG2E = 1.4426950408889634


@jit
def _mla_decode_kernel(ql_ptr, qr_ptr, cache_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
                       H: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr,
                       R: tl.constexpr, D: tl.constexpr,
                       NB: tl.constexpr, BS: tl.constexpr, LAYER_ROWS: tl.constexpr, SPLIT_LEN: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, QK_SCALE: tl.constexpr,
                       FP8: tl.constexpr, SCALE_COL: tl.constexpr):
    hb = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    # Program rows are (query row, head) pairs m = row * H + head; each query row sees its own length.
    offs_h = hb * BH + tl.arange(0, BH)
    h_ok = offs_h < M
    start = s * SPLIT_LEN
    if ROWS == 1:  # one length for the program: a scalar (a [BH] vector costs registers, spilled at 64 x 512)
        end = tl.minimum(tl.load(len_ptr + b), start + SPLIT_LEN)
    else:
        lim = tl.load(len_ptr + b * ROWS + offs_h // H, mask=h_ok, other=0)  # [BH] tokens each row attends to
        end = tl.minimum(tl.max(lim, 0), start + SPLIT_LEN)
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    q_row = (b * M + offs_h).to(tl.int64)
    q = tl.load(ql_ptr + q_row[:, None] * C + offs_c[None, :], mask=h_ok[:, None], other=0.0)  # [BH, C]
    qr = tl.load(qr_ptr + q_row[:, None] * R + offs_r[None, :], mask=h_ok[:, None], other=0.0)  # [BH, R]
    cdt = q.dtype
    # The layer's first row: int64, a whole cache passes 2**31 elements at DeepSeek-V3's size.
    base = cache_ptr + tl.full((), LAYER_ROWS, tl.int64) * D
    if FP8:
        base = base.to(tl.pointer_type(tl.uint8))

    m = tl.full((BH,), -1e30, tl.float32)  # finite: exp2(m - m_new) never sees inf - inf
    l = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, C), tl.float32)
    offs_n = tl.arange(0, BN)
    for t0 in range(start, end, BN):
        t = t0 + offs_n
        valid = t < end
        page = tl.load(bt_ptr + b * NB + t // BS, mask=valid, other=0)
        row = base + (page.to(tl.int64) * BS + t % BS) * D  # [BN] row pointers
        if FP8:
            k = tl.load(row[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
            k = k.to(tl.float8e4nv, bitcast=True).to(cdt)
            kr = tl.load(row[:, None] + C + offs_r[None, :], mask=valid[:, None], other=0)
            kr = kr.to(tl.float8e4nv, bitcast=True).to(cdt)
            byte = tl.load(row + SCALE_COL, mask=valid, other=127)
            row_scale = tl.exp2(byte.to(tl.float32) - 127.0)  # [BN]
        else:
            k = tl.load(row[:, None] + offs_c[None, :], mask=valid[:, None], other=0.0).to(cdt)  # [BN, C]
            kr = tl.load(row[:, None] + C + offs_r[None, :], mask=valid[:, None], other=0.0).to(cdt)  # [BN, R]
        sc = tl.dot(q, tl.trans(k)) + tl.dot(qr, tl.trans(kr))  # [BH, BN] f32
        if FP8:
            sc = sc * (row_scale * QK_SCALE)[None, :]
        else:
            sc = sc * QK_SCALE
        if ROWS == 1:
            sc = tl.where(valid[None, :], sc, float("-inf"))
        else:
            sc = tl.where(t[None, :] < lim[:, None], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if FP8:
            p = p * row_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(cdt), k)
        m = m_new

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    o_row = ((b * NUM_SPLITS + s) * MP + offs_h).to(tl.int64)
    tl.store(o_ptr + o_row[:, None] * C + offs_c[None, :], out.to(o_ptr.dtype.element_ty), mask=h_ok[:, None])
    # Natural-log lse (the splits' combination is shared with the Pallas kernel).
    lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + o_row, lse, mask=h_ok)


def triton_mla_decode(q_latent, q_rope, cache, block_tables, seq_lens, *, block_size: int, scale: float,
                      layer: int | None = None, block_h: int = 64, block_n: int = 64, num_splits: int = 1,
                      num_warps: int = 8, num_stages: int = 2, out_dtype=None, interpret: bool | None = None):
    """q_latent [B, H, C], q_rope [B, H, R], cache [num_slots, D] or [L, num_slots, D] (``layer`` picks
    one), block_tables [B, nb], seq_lens [B] (>= 1) -> context [B, H, C] in ``out_dtype`` (float32 by
    default), as ``paged_decode_attention`` (bf16 cache rows [latent | rope], or kv_quant FP8 rows).

    Several query rows a sequence (the speculative verify's k + 1): q_latent [B, Q, H, C], q_rope
    [B, Q, H, R] and seq_lens [B, Q], row q attending to the first seq_lens[b, q] tokens of the
    sequence's one block table (causal among the rows: P+1, ..., P+Q); the context is read once for all
    of a sequence's rows (they are the programs' M rows beside the heads) -> [B, Q, H, C].

    C and R must be powers of two >= 16 (Triton blocks); ``block_h`` (query row, head) pairs a program
    (padded past Q x H), ``block_n`` tokens a step, the context cut into ``num_splits`` pieces."""
    rows = q_latent.ndim == 4
    if not rows:
        q_latent, seq_lens = q_latent[:, None], seq_lens[:, None]
        q_rope = None if q_rope is None else q_rope[:, None]
    if q_latent.ndim != 4:
        raise ValueError(f"q_latent: expected [B, H, C] or [B, Q, H, C], got {q_latent.shape}")
    B, Q, H, C = q_latent.shape
    if q_rope is None or q_rope.shape[:3] != (B, Q, H):
        want = f"[B={B}, Q={Q}, H={H}, R]" if rows else f"[B={B}, H={H}, R]"
        raise ValueError(f"q_rope: expected {want}, got {None if q_rope is None else q_rope.shape}")
    if seq_lens.shape != (B, Q):
        raise ValueError(f"seq_lens: expected [{B}{f', {Q}' if rows else ''}], got {seq_lens.shape}")
    cache, layer = layered_cache(cache, layer, block_tables, B)
    R = q_rope.shape[-1]
    for name, v in (("latent dim", C), ("rope dim", R), ("block_h", block_h), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16 for the Triton MLA kernel, got {v}")
    L, slots, D = cache.shape
    fp8 = jnp.dtype(cache.dtype).itemsize == 1
    if D < C + R + (1 if fp8 else 0):
        raise ValueError(f"cache: rows of {D} cannot hold latent {C} + rope {R}{' + a scale byte' if fp8 else ''}")
    nb = block_tables.shape[1]
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    max_len = nb * block_size
    split_len = pl.cdiv(pl.cdiv(max_len, num_splits), block_n) * block_n
    num_splits = pl.cdiv(max_len, split_len)
    M = Q * H
    Mp = pl.cdiv(M, block_h) * block_h
    cdt = q_latent.dtype
    o, lse = triton_call(
        q_latent.reshape(B, M, C), q_rope.astype(cdt).reshape(B, M, R), cache, block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        kernel=_mla_decode_kernel,
        out_shape=[jax.ShapeDtypeStruct((B, num_splits, Mp, C), out_dtype if num_splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((B, num_splits, Mp), jnp.float32)],
        grid=(Mp // block_h, num_splits, B),
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        H=H, M=M, MP=Mp, ROWS=Q, C=C, R=R, D=D, NB=nb, BS=block_size, LAYER_ROWS=layer * slots,
        SPLIT_LEN=split_len, NUM_SPLITS=num_splits, BH=block_h, BN=block_n, QK_SCALE=float(scale) * LOG2E, FP8=fp8,
        SCALE_COL=C + R)
    out = combine_splits(o, lse, out_dtype)[:, :M].reshape(B, Q, H, C)
    return out if rows else out[:, 0]
