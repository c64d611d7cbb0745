"""Prefill attention, MLA and MFA, memory-bounded on every path: no [S, S] score tensor.

``prefill_attention`` is causal attention of the last ``seq_lens[b]`` positions of a context
of ``ctx_lens[b]`` tokens against dense keys / values (MLA: kv_b_proj's expanded [k_nope | v]
per head plus one shared rope key; MFA: the [k | v] row of each K/V head, shared by its query
heads). The kernel selection (``kernel_selection.select_prefill``) picks the Pallas flash
kernel (pallas_kernels/flash_prefill_attention.py, on GPU) or the XLA path here: query chunks
of ``block_q`` tokens (``lax.map``), each walking key blocks of ``block_k`` (``fori_loop``, up
to the chunk's last position only) with an online softmax. Either way the largest
temporary is one chunk's [B, heads, block_q, block_k] float32 scores, whatever S is.

``packed_prefill_attention`` is the same for whole prompts packed back to back in one token
stream (q [T, H, Dk], kv [T, Hk, W], cumulative offsets ``cu_seqlens`` [B + 1]; each prompt
attends causally to its own tokens, nothing is padded to the longest prompt): the kernel's
packed grid, or the XLA path here over the stream as one sequence with segment ids masking
keys of other prompts.

``paged_prefill_attention`` is the chunked-prefill form: keys for positions [0, ctx_len) are
read from the paged cache through the block table, one segment of ``segment`` tokens at a
time (gathered, dequantised for an FP8 cache, expanded by the caller's ``expand``), and the
segments' partial results are merged through their log-sum-exp. Memory: one segment's
expanded K/V and the chunk's float32 accumulator, whatever the context length.

Semantics of the positions (both paths, and the kernel): query i of sequence b sits at
position ``ctx_lens[b] - seq_lens[b] + i``; key j of ``kv`` at ``kv_start[b] + j``; query
rows past ``seq_lens`` come back as zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moejax import kernel_selection
from moejax.layers.kv_quant import as_model_dtype, dequantize_rows, is_fp8_cache
from moejax.layers.linear import einsum_f32
from pallas_kernels.flash_prefill_attention import (check_packed, flash_packed_prefill_attention,
                                                    flash_prefill_attention)


def _lengths(B, seq_lens, ctx_lens, kv_start):
    seq_lens = seq_lens.astype(jnp.int32)
    ctx_lens = seq_lens if ctx_lens is None else ctx_lens.astype(jnp.int32)
    kv_start = jnp.zeros((B,), jnp.int32) if kv_start is None else jnp.broadcast_to(kv_start, (B,)).astype(jnp.int32)
    return seq_lens, ctx_lens, kv_start


def xla_prefill_attention(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale: float, q_rope=None, k_rope=None,
                          v_offset: int | None = None, v_dim: int | None = None, block_q: int = 256,
                          block_k: int = 512, out_dtype=jnp.float32, return_lse: bool = False):
    """The XLA path of ``prefill_attention`` (same arguments and results as
    pallas_kernels.flash_prefill_attention.flash_prefill_attention), blocked over query chunks
    of ``block_q`` tokens and key blocks of ``block_k``."""
    seq_lens, ctx_lens, kv_start = _lengths(q.shape[0], seq_lens, ctx_lens, kv_start)
    return _xla_blocked(q, kv, seq_lens, ctx_lens, kv_start, None, scale=scale, q_rope=q_rope, k_rope=k_rope,
                        v_offset=v_offset, v_dim=v_dim, block_q=block_q, block_k=block_k, out_dtype=out_dtype,
                        return_lse=return_lse)


def xla_packed_prefill_attention(q, kv, cu_seqlens, *, scale: float, q_rope=None, k_rope=None,
                                 v_offset: int | None = None, v_dim: int | None = None, block_q: int = 256,
                                 block_k: int = 512, out_dtype=jnp.float32, return_lse: bool = False):
    """The XLA path of ``packed_prefill_attention`` (same arguments and results as
    pallas_kernels.flash_prefill_attention.flash_packed_prefill_attention): the stream as one
    sequence of cu_seqlens[B] live tokens, blocked like ``xla_prefill_attention``, with a key
    seeing a query only inside the query's own sequence (segment ids). A query chunk walks the
    keys from its first token's sequence start, not from the stream's."""
    check_packed(q, kv, cu_seqlens)
    T = q.shape[0]
    cu = cu_seqlens.astype(jnp.int32)
    segment = jnp.searchsorted(cu[1:], jnp.arange(T, dtype=jnp.int32), side="right").astype(jnp.int32)
    n = cu[-1:]
    r = None if q_rope is None else q_rope[None]
    out = _xla_blocked(q[None], kv[None], n, n, jnp.zeros((1,), jnp.int32), (segment, cu), scale=scale, q_rope=r,
                       k_rope=None if k_rope is None else k_rope[None], v_offset=v_offset, v_dim=v_dim,
                       block_q=block_q, block_k=block_k, out_dtype=out_dtype, return_lse=return_lse)
    return (out[0][0], out[1][0]) if return_lse else out[0]


def _xla_blocked(q, kv, seq_lens, ctx_lens, kv_start, segments, *, scale, q_rope, k_rope, v_offset, v_dim,
                 block_q, block_k, out_dtype, return_lse):
    """Both XLA paths. ``segments``: None (batched), or for a packed stream (B = 1) the sequence
    of each token [T] and cu_seqlens: keys outside a query's sequence are masked."""
    B, Tq, H, Dk = q.shape
    _, Tk, Hk, _ = kv.shape
    g = H // Hk
    v_off = Dk if v_offset is None else v_offset
    Dv = v_dim or Dk
    R = 0 if q_rope is None else q_rope.shape[-1]
    cdt = q.dtype
    bq, bk = min(block_q, Tq), min(block_k, Tk)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    pad = lambda x, n, axis=1, value=0: x if n == x.shape[axis] else jnp.pad(  # noqa: E731
        x, [(0, n - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)], constant_values=value)
    qg = pad(q, nq * bq).reshape(B, nq * bq, Hk, g, Dk)
    qrg = pad(q_rope.astype(cdt), nq * bq).reshape(B, nq * bq, Hk, g, R) if R else None
    kvp = pad(kv.astype(cdt), nk * bk)
    krp = pad(k_rope.astype(cdt), nk * bk) if R else None
    q0 = ctx_lens - seq_lens  # position of query 0
    kv_len = jnp.clip(ctx_lens - kv_start, 0, Tk)
    if segments is not None:
        seg, cu = segments
        seg_q, seg_k = pad(seg, nq * bq, 0, -1), pad(seg, nk * bk, 0, -2)  # padding matches nothing

    def chunk(i):
        tok = i * bq + jnp.arange(bq, dtype=jnp.int32)  # [bq]
        qpos = q0[:, None] + tok[None, :]  # [B, bq]
        live = tok[None, :] < seq_lens[:, None]
        qc = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=1)
        qrc = jax.lax.dynamic_slice_in_dim(qrg, i * bq, bq, axis=1) if R else None
        last = jnp.minimum(i * bq + bq - 1, seq_lens - 1)
        hi = jnp.where(i * bq < seq_lens, jnp.clip(jnp.minimum(kv_len, q0 + last - kv_start + 1), 0, Tk), 0)
        n_blocks = jnp.max((hi + bk - 1) // bk)  # the chunk's furthest key, over the batch
        first_block = 0
        if segments is not None:  # keys before the chunk's first sequence are nobody's in it
            sq = jax.lax.dynamic_slice_in_dim(seg_q, i * bq, bq)
            first_block = cu[jnp.clip(sq[0], 0, cu.shape[0] - 1)] // bk

        def body(j, carry):
            m, l, acc = carry  # [B, Hk, g, bq] x2, [B, Hk, g, bq, Dv]
            blk = jax.lax.dynamic_slice_in_dim(kvp, j * bk, bk, axis=1)  # [B, bk, Hk, W]
            s = einsum_f32("bqhgd,bkhd->bhgqk", qc, blk[..., :Dk])
            if R:
                kr = jax.lax.dynamic_slice_in_dim(krp, j * bk, bk, axis=1)
                s = s + einsum_f32("bqhgr,bkr->bhgqk", qrc, kr)
            kj = j * bk + jnp.arange(bk, dtype=jnp.int32)
            ok = (kj[None, None, :] < kv_len[:, None, None]) & \
                 (kv_start[:, None, None] + kj[None, None, :] <= qpos[:, :, None])  # [B, bq, bk]
            if segments is not None:
                ok = ok & (jax.lax.dynamic_slice_in_dim(seg_k, j * bk, bk)[None, None, :] == sq[None, :, None])
            s = jnp.where(ok[:, None, None], s * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            l_new = l * alpha + jnp.sum(p, axis=-1)
            pv = einsum_f32("bhgqk,bkhd->bhgqd", p.astype(cdt), blk[..., v_off:v_off + Dv])
            return m_new, l_new, acc * alpha[..., None] + pv

        f32 = jnp.float32
        init = (jnp.full((B, Hk, g, bq), -1e30, f32), jnp.zeros((B, Hk, g, bq), f32),
                jnp.zeros((B, Hk, g, bq, Dv), f32))
        m, l, acc = jax.lax.fori_loop(first_block, n_blocks, body, init)
        has = (l > 0) & live[:, None, None, :]
        safe = jnp.where(has, l, 1.0)
        o = jnp.where(has[..., None], acc / safe[..., None], 0.0).astype(out_dtype)
        lse = jnp.where(has, m + jnp.log(safe), -jnp.inf)
        # [B, Hk, g, bq, ...] -> [B, bq, H, ...]
        return (jnp.moveaxis(o, 3, 1).reshape(B, bq, H, Dv), jnp.moveaxis(lse, 3, 1).reshape(B, bq, H))

    o, lse = jax.lax.map(chunk, jnp.arange(nq, dtype=jnp.int32))  # sequential: one chunk live at a time
    o = jnp.moveaxis(o, 0, 1).reshape(B, nq * bq, H, Dv)[:, :Tq]
    lse = jnp.moveaxis(lse, 0, 1).reshape(B, nq * bq, H)[:, :Tq]
    return (o, lse) if return_lse else o


def prefill_attention(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale: float, q_rope=None, k_rope=None,
                      v_offset: int | None = None, v_dim: int | None = None, out_dtype=jnp.float32,
                      return_lse: bool = False, mode: str | None = None):
    """Causal prefill attention through the selected path (Pallas kernel or XLA blocked).

    q [B, Tq, H, Dk]; kv [B, Tk, Hk, W] (keys columns [0, Dk), values [v_offset, v_offset + Dv));
    q_rope [B, Tq, H, R] / k_rope [B, Tk, R] (one rope key for all heads) or None;
    seq_lens [B], ctx_lens [B] (default seq_lens), kv_start [B] (default 0).
    -> [B, Tq, H, Dv] in out_dtype (and the log-sum-exp [B, Tq, H] with ``return_lse``)."""
    B, Tq, H, Dk = q.shape
    _, Tk, Hk, _ = kv.shape
    R = 0 if q_rope is None else q_rope.shape[-1]
    Dv = v_dim or Dk
    c = kernel_selection.select_prefill(B, Tq, Tk, H, Hk, Dk, R, Dv, q.dtype, mode)
    fn = flash_prefill_attention if c.impl == "pallas" else xla_prefill_attention
    return fn(q, kv, seq_lens, ctx_lens, kv_start, scale=float(scale), q_rope=q_rope, k_rope=k_rope,
              v_offset=v_offset, v_dim=v_dim, out_dtype=out_dtype, return_lse=return_lse, **c.params)


def packed_prefill_attention(q, kv, cu_seqlens, *, scale: float, q_rope=None, k_rope=None,
                             v_offset: int | None = None, v_dim: int | None = None, out_dtype=jnp.float32,
                             return_lse: bool = False, mode: str | None = None):
    """Causal self-attention of whole prompts packed in one token stream (Pallas kernel or XLA blocked).

    q [T, H, Dk]; kv [T, Hk, W]; q_rope [T, H, R] / k_rope [T, R] or None; cu_seqlens [B + 1]:
    sequence b is the tokens [cu_seqlens[b], cu_seqlens[b + 1]) at positions 0, 1, ...
    -> [T, H, Dv] in out_dtype (and the log-sum-exp [T, H]); tokens past cu_seqlens[B] are zeros.
    The selection is the batched one's for one sequence of T tokens."""
    T, H, Dk = q.shape
    Hk = kv.shape[1]
    R = 0 if q_rope is None else q_rope.shape[-1]
    c = kernel_selection.select_prefill(1, T, T, H, Hk, Dk, R, v_dim or Dk, q.dtype, mode)
    fn = flash_packed_prefill_attention if c.impl == "pallas" else xla_packed_prefill_attention
    return fn(q, kv, cu_seqlens, scale=float(scale), q_rope=q_rope, k_rope=k_rope, v_offset=v_offset, v_dim=v_dim,
              out_dtype=out_dtype, return_lse=return_lse, **c.params)


def check_prefill_mode(x, cu_seqlens, block_tables) -> None:
    """An attention layer's prefill input: [B, S, hidden], or [T, hidden] for a packed stream
    (``cu_seqlens``), which attends to itself only (no paged context)."""
    if cu_seqlens is None:
        if x.ndim != 3:
            raise ValueError(f"x must be [batch, tokens, hidden] (or [T, hidden] with cu_seqlens), got {x.shape}")
        return
    if block_tables is not None:
        raise ValueError("cu_seqlens (packed prefill) and block_tables (chunks over the paged cache) do not combine")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, hidden] with cu_seqlens (a packed stream), got {x.shape}")


def merge_partials(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets from each one's normalised output
    [..., D] and log-sum-exp [...] (-inf: saw no key)."""
    mx = jnp.maximum(lse_a, lse_b)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    wa, wb = jnp.exp(lse_a - mx), jnp.exp(lse_b - mx)
    tot = wa + wb
    safe = jnp.where(tot > 0, tot, 1.0)
    o = (o_a * wa[..., None] + o_b * wb[..., None]) / safe[..., None]
    return o, jnp.where(tot > 0, mx + jnp.log(safe), -jnp.inf)


def paged_prefill_attention(q, cache, block_tables, seq_lens, ctx_lens, block_size: int, *,
                            expand: Callable, scale: float, row_dim: int, q_rope=None, layer: int | None = None,
                            v_offset: int | None = None, v_dim: int | None = None, segment: int | None = None,
                            out_dtype=jnp.float32, mode: str | None = None):
    """Chunked prefill: the chunk's queries against keys [0, ctx_len) read from the paged cache.

    q [B, Tq, H, Dk] (and q_rope): the last seq_lens[b] positions of contexts of ctx_lens[b]
    tokens, whose cache rows (the chunk's own included) are already written; cache
    [L, num_slots, D'] with ``layer`` (or [num_slots, D']); block_tables [B, nb].
    ``expand(rows [B, T, row_dim]) -> (kv [B, T, Hk, W], k_rope [B, T, R] or None)`` turns cache
    rows into keys / values (MLA: latents through kv_b_proj; MFA: a reshape). Keys are taken in
    segments of ``segment`` tokens (a multiple of block_size), each attended with
    ``prefill_attention`` and merged by log-sum-exp; segments past the longest context are skipped."""
    B, Tq, H, Dk = q.shape
    nb = block_tables.shape[1]
    seg = segment or kernel_selection.prefill_segment(B, H, nb * block_size, block_size)
    seg = max(block_size, seg // block_size * block_size)
    pages = seg // block_size
    n_seg = -(-nb // pages)
    tables = block_tables.astype(jnp.int32)
    if n_seg * pages != nb:
        tables = jnp.pad(tables, ((0, 0), (0, n_seg * pages - nb)))  # page 0: masked by ctx_lens
    seq_lens, ctx_lens, _ = _lengths(B, seq_lens, ctx_lens, None)
    offs = jnp.arange(block_size, dtype=jnp.int32)
    fp8 = is_fp8_cache(cache)
    Dv = v_dim or Dk

    def body(s, carry):
        o_acc, lse_acc = carry
        pg = jax.lax.dynamic_slice_in_dim(tables, s * pages, pages, axis=1)  # [B, pages]
        slots = (pg[:, :, None] * block_size + offs).reshape(B, seg)
        rows = cache[slots] if layer is None else cache[layer, slots]  # [B, seg, D']: the only cache read
        if fp8:
            rows = dequantize_rows(rows, row_dim).astype(q.dtype)
        else:
            rows = as_model_dtype(rows[..., :row_dim], q.dtype)
        kv, k_rope = expand(rows)
        o, lse = prefill_attention(q, kv, seq_lens, ctx_lens, s * seg, scale=scale, q_rope=q_rope, k_rope=k_rope,
                                   v_offset=v_offset, v_dim=v_dim, out_dtype=jnp.float32, return_lse=True,
                                   mode=mode)
        return merge_partials(o_acc, lse_acc, o, lse)

    init = (jnp.zeros((B, Tq, H, Dv), jnp.float32), jnp.full((B, Tq, H), -jnp.inf, jnp.float32))
    n_live = (jnp.max(ctx_lens) + seg - 1) // seg
    o, _ = jax.lax.fori_loop(0, jnp.minimum(n_live, n_seg), body, init)
    return o.astype(out_dtype)
