"""Prefill attention, MLA and MFA: the Pallas flash kernel (pallas_kernels/flash_prefill_attention.py)
or XLA's blocked path (``xla`` / ``xla_packed``: query chunks of ``block_q`` tokens (``lax.map``), each
walking key blocks of ``block_k`` (``fori_loop``, up to the chunk's last position only) with an online
softmax). ``plan`` decides once from the shapes and dtype; ``run`` / ``run_packed`` compute its path.
Either way the largest temporary is one chunk's [B, heads, block_q, block_k] float32 scores.

Kernel rule: on GPU where the dims are Triton blocks (qk_dim, rope_dim (0: none), v_dim powers of two
>= 16). Its tiles (``block_q`` counts query rows: tokens x the heads sharing one K/V head) in
FLASH_TILES. XLA's chunks sized so one chunk's float32 scores stay near XLA_SCORE_BUDGET.
Measured: BENCHMARKS.md, "Prefill" (H200, attention alone at 1 x 8192, scripts/bench_prefill.py --sweep:
MLA 6.55 ms, 9.5x XLA; Step3 MFA 4.77 ms, 6.0x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import common
from moejax.kernels.common import Plan, einsum_f32, plan_reason, pow2, triton_dim, want_kernel
from pallas_kernels.flash_prefill_attention import check_packed, flash_packed_prefill_attention, flash_prefill_attention

# (largest of qk_dim + rope_dim and v_dim up to, tiles): MLA's 192 three stages; wider (Step3's 256)
# two (three, or 128-key tiles, exceed shared memory). ROCm: 32-key tiles, one stage (64 KB of LDS; not run).
FLASH_TILES = ((192, dict(block_q=128, block_k=64, num_warps=8, num_stages=3)),
               (None, dict(block_q=128, block_k=64, num_warps=8, num_stages=2)))
XLA_SCORE_BUDGET = {"cpu": 16 << 20, "gpu": 256 << 20}  # bytes of one chunk's float32 scores
XLA_MAX_BLOCK_Q, XLA_MAX_BLOCK_K = 1024, 512


def plan(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, qk_dim: int, rope_dim: int,
         v_dim: int, dtype, mode: str | None = None) -> Plan:
    """"pallas" (the flash kernel) with its tiles, or "xla" with its query chunk ``block_q`` (tokens) and
    key block ``block_k``."""
    use, forced = want_kernel(mode)
    pallas_ok = jnp.dtype(dtype) in common.FLOAT_DTYPES
    dims_ok = triton_dim(qk_dim) and triton_dim(v_dim) and (rope_dim == 0 or triton_dim(rope_dim))
    if use and pallas_ok and (forced or dims_ok):
        rows = q_len * (heads // max(kv_heads, 1))
        width = max(qk_dim + rope_dim, v_dim)
        p = dict(next(t for upto, t in FLASH_TILES if upto is None or width <= upto))
        if common.platform() == "rocm":
            p.update(block_k=32, num_stages=1)
        p["block_q"] = min(p["block_q"], pow2(rows, 16))
        p["block_k"] = min(p["block_k"], pow2(kv_len, 16))
        return Plan("pallas", p, plan_reason(forced))
    budget = XLA_SCORE_BUDGET["cpu" if common.platform() == "cpu" else "gpu"]
    block_k = min(XLA_MAX_BLOCK_K, pow2(kv_len, 16))
    block_q = pow2(budget // max(1, 4 * batch * heads * block_k), 16, down=True)
    block_q = max(16, min(block_q, XLA_MAX_BLOCK_Q, pow2(q_len, 16)))
    why = "mode or platform" if not use else (f"dtype {jnp.dtype(dtype)}" if not pallas_ok else
                                              "dims not powers of two >= 16 (Triton blocks)")
    return Plan("xla", dict(block_q=block_q, block_k=block_k), why)


def segment(batch: int, heads: int, max_len: int, block_size: int) -> int:
    """Keys per segment of chunked prefill over the paged cache (layers/prefill_attention.py): one
    segment's gathered rows are expanded to [batch, segment, heads, k + v]; 4096 tokens is 256 MB per
    sequence for DeepSeek-V3 (128 heads x 256 bf16 values) and one segment holds most contexts whole.
    Wide batches take shorter segments, so the expanded keys stay within about eight such sequences
    (2 GB at 128 heads): a chunk batch of 256 with 4096-token segments asked XLA for 8 GB (out of memory
    beside the KV cache on an H100)."""
    seg = max(block_size, (4096 * 128) // max(heads, 1))
    seg = min(seg, (8 * 4096 * 128) // max(heads * batch, 1))
    seg = min(seg, -(-max_len // block_size) * block_size)
    return max(block_size, seg // block_size * block_size)


def run(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale: float, q_rope=None, k_rope=None,
        v_offset: int | None = None, v_dim: int | None = None, out_dtype=jnp.float32, return_lse: bool = False,
        mode: str | None = None):
    """Batched causal prefill attention on the planned path (layers/prefill_attention.prefill_attention
    says the arguments)."""
    B, Tq, H, Dk = q.shape
    _, Tk, Hk, _ = kv.shape
    R = 0 if q_rope is None else q_rope.shape[-1]
    pl = plan(B, Tq, Tk, H, Hk, Dk, R, v_dim or Dk, q.dtype, mode)
    fn = flash_prefill_attention if pl.path == "pallas" else xla
    return fn(q, kv, seq_lens, ctx_lens, kv_start, scale=float(scale), q_rope=q_rope, k_rope=k_rope,
              v_offset=v_offset, v_dim=v_dim, out_dtype=out_dtype, return_lse=return_lse, **pl.params)


def run_packed(q, kv, cu_seqlens, *, scale: float, q_rope=None, k_rope=None, v_offset: int | None = None,
               v_dim: int | None = None, out_dtype=jnp.float32, return_lse: bool = False, mode: str | None = None):
    """Packed causal prefill attention on the planned path: the batched plan for one sequence of T tokens."""
    T, H, Dk = q.shape
    Hk = kv.shape[1]
    R = 0 if q_rope is None else q_rope.shape[-1]
    pl = plan(1, T, T, H, Hk, Dk, R, v_dim or Dk, q.dtype, mode)
    fn = flash_packed_prefill_attention if pl.path == "pallas" else xla_packed
    return fn(q, kv, cu_seqlens, scale=float(scale), q_rope=q_rope, k_rope=k_rope, v_offset=v_offset, v_dim=v_dim,
              out_dtype=out_dtype, return_lse=return_lse, **pl.params)


def lengths(B, seq_lens, ctx_lens, kv_start):
    seq_lens = seq_lens.astype(jnp.int32)
    ctx_lens = seq_lens if ctx_lens is None else ctx_lens.astype(jnp.int32)
    kv_start = jnp.zeros((B,), jnp.int32) if kv_start is None else jnp.broadcast_to(kv_start, (B,)).astype(jnp.int32)
    return seq_lens, ctx_lens, kv_start


def xla(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale: float, q_rope=None, k_rope=None,
                          v_offset: int | None = None, v_dim: int | None = None, block_q: int = 256,
                          block_k: int = 512, out_dtype=jnp.float32, return_lse: bool = False):
    """The XLA path of ``prefill_attention`` (same arguments and results as
    pallas_kernels.flash_prefill_attention.flash_prefill_attention), blocked over query chunks
    of ``block_q`` tokens and key blocks of ``block_k``."""
    seq_lens, ctx_lens, kv_start = lengths(q.shape[0], seq_lens, ctx_lens, kv_start)
    return _xla_blocked(q, kv, seq_lens, ctx_lens, kv_start, None, scale=scale, q_rope=q_rope, k_rope=k_rope,
                        v_offset=v_offset, v_dim=v_dim, block_q=block_q, block_k=block_k, out_dtype=out_dtype,
                        return_lse=return_lse)


def xla_packed(q, kv, cu_seqlens, *, scale: float, q_rope=None, k_rope=None,
                                 v_offset: int | None = None, v_dim: int | None = None, block_q: int = 256,
                                 block_k: int = 512, out_dtype=jnp.float32, return_lse: bool = False):
    """The XLA path of ``packed_prefill_attention`` (same arguments and results as
    pallas_kernels.flash_prefill_attention.flash_packed_prefill_attention): the stream as one
    sequence of cu_seqlens[B] live tokens, blocked like ``xla``, with a key
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
