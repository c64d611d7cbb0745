"""Prefill attention, MLA and MFA, memory-bounded on every path: no [S, S] score tensor.

``prefill_attention`` is causal attention of the last ``seq_lens[b]`` positions of a context
of ``ctx_lens[b]`` tokens against dense keys / values (MLA: kv_b_proj's expanded [k_nope | v]
per head plus one shared rope key; MFA: the [k | v] row of each K/V head, shared by its query
heads), on the path moejax/kernels/prefill.py plans: the Pallas flash kernel (on GPU) or XLA's
blocked path. Either way the largest temporary is one chunk's [B, heads, block_q, block_k]
float32 scores, whatever S is.

``packed_prefill_attention`` is the same for whole prompts packed back to back in one token
stream (q [T, H, Dk], kv [T, Hk, W], cumulative offsets ``cu_seqlens`` [B + 1]; each prompt
attends causally to its own tokens, nothing is padded to the longest prompt): the kernel's
packed grid, or the XLA path over the stream as one sequence with segment ids masking
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

from moejax.kernels import prefill
from moejax.kernels.kv_quant import as_model_dtype, dequantize_rows, is_fp8_cache


def prefill_attention(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale: float, q_rope=None, k_rope=None,
                      v_offset: int | None = None, v_dim: int | None = None, out_dtype=jnp.float32,
                      return_lse: bool = False, mode: str | None = None):
    """Causal prefill attention on the planned path (moejax/kernels/prefill.py: the flash kernel or XLA).

    q [B, Tq, H, Dk]; kv [B, Tk, Hk, W] (keys columns [0, Dk), values [v_offset, v_offset + Dv));
    q_rope [B, Tq, H, R] / k_rope [B, Tk, R] (one rope key for all heads) or None;
    seq_lens [B], ctx_lens [B] (default seq_lens), kv_start [B] (default 0).
    -> [B, Tq, H, Dv] in out_dtype (and the log-sum-exp [B, Tq, H] with ``return_lse``)."""
    return prefill.run(q, kv, seq_lens, ctx_lens, kv_start, scale=scale, q_rope=q_rope, k_rope=k_rope,
                       v_offset=v_offset, v_dim=v_dim, out_dtype=out_dtype, return_lse=return_lse, mode=mode)


def packed_prefill_attention(q, kv, cu_seqlens, *, scale: float, q_rope=None, k_rope=None,
                             v_offset: int | None = None, v_dim: int | None = None, out_dtype=jnp.float32,
                             return_lse: bool = False, mode: str | None = None):
    """Causal self-attention of whole prompts packed in one token stream (the flash kernel or XLA).

    q [T, H, Dk]; kv [T, Hk, W]; q_rope [T, H, R] / k_rope [T, R] or None; cu_seqlens [B + 1]:
    sequence b is the tokens [cu_seqlens[b], cu_seqlens[b + 1]) at positions 0, 1, ...
    -> [T, H, Dv] in out_dtype (and the log-sum-exp [T, H]); tokens past cu_seqlens[B] are zeros."""
    return prefill.run_packed(q, kv, cu_seqlens, scale=scale, q_rope=q_rope, k_rope=k_rope, v_offset=v_offset,
                              v_dim=v_dim, out_dtype=out_dtype, return_lse=return_lse, mode=mode)


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
    seg = segment or prefill.segment(B, H, nb * block_size, block_size)
    seg = max(block_size, seg // block_size * block_size)
    pages = seg // block_size
    n_seg = -(-nb // pages)
    tables = block_tables.astype(jnp.int32)
    if n_seg * pages != nb:
        tables = jnp.pad(tables, ((0, 0), (0, n_seg * pages - nb)))  # page 0: masked by ctx_lens
    seq_lens, ctx_lens, _ = prefill.lengths(B, seq_lens, ctx_lens, None)
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
