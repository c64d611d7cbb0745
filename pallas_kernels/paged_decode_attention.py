"""Decode attention over the paged cache for MLA and MFA (Pallas, Triton backend).

One kernel serves DeepSeek's absorbed MLA (queries in the latent space against
[latent | rope key] rows, ``q_rope`` given) and Step3's MFA (every query head against
one shared [k | v] row, ``q_rope=None``, values at column ``v_offset``).

Flash-decoding in two stages:

1. Grid (head blocks, KV splits, batch). Program (h, s, b) takes ``block_h``
   query heads of sequence ``b`` and the ``s``-th slice of its context, walks
   that slice in tiles and keeps an online softmax. It writes its partial
   context (already normalised) and its log-sum-exp. The head-block axis is the
   fastest grid axis, so the programs of all head blocks of one (sequence,
   split) run together and share each tile through L2: HBM sees the sequence's
   cache about once. No copy of the cache is ever made. Two tilings:
   ``_mla_split_kernel`` ("gather") takes ``block_t`` tokens per step, each
   token's slot read through the block table, so one tile spans several pages
   and feeds one score dot and one value dot; ``_mla_pages_kernel`` ("pages")
   takes whole pages, one scalar page id and a contiguous [block_size, D] slab
   each, one pair of dots per page. Both load through masked loads (zero fill)
   that feed the dots directly, so Triton stages tiles through shared memory
   asynchronously. On the H200 the gather tile with 64 tokens is the faster one
   for bf16 caches (1.2x at 16 heads, 2x at 128): the page tile's 16-token score
   dot made Triton's warps re-read the same key tile from shared memory, which
   Nsight Compute showed as the bound (benchmarks/2026-12-03b/).
2. Reduction over splits (plain JAX, fused by XLA): weights exp(lse_s - lse_max).
   With one split, stage 1 writes the final result and there is no stage 2.

Variable lengths share one batch: tiles past a sequence's length are never
visited, the last tile is masked. Cache rows are either the model dtype
(bf16/f32) or FP8 e4m3 with a per-row power-of-two scale in an extra byte
(moejax/kernels/kv_quant.py); the kernel reads that byte and applies the scale
to the scores and the probabilities (s_t scales both K_t and V_t).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import compiler_params, interpret_mode, masked_load

FP8 = jnp.float8_e4m3fn


def _online_softmax(n_tiles, body, BH: int, C: int, o_ref, lse_ref):
    """Runs ``body`` (m, l, acc) -> (m, l, acc) over the tiles; writes the normalised context and the
    log-sum-exp (-inf where the split saw no token)."""
    f32 = jnp.float32
    # m starts at a large finite negative number (not -inf) so that exp(m - m_new) never sees inf - inf.
    init = (jnp.full((BH,), -1e30, f32), jnp.zeros((BH,), f32), jnp.zeros((BH, C), f32))
    m, l, acc = jax.lax.fori_loop(0, n_tiles, body, init)
    has = l > 0
    o_ref[...] = (acc / jnp.where(has, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


def _load_rows(cache_ref, layer: int, rows, start: int, width: int, valid, fp8: bool, cdt, interpret: bool):
    """Cache rows ``rows`` (a slice or a vector of slots), columns [start, start + width), in the compute
    dtype: zero where ``valid`` [rows] is False, except FP8 rows, read as they are (below)."""
    # FP8: a plain load, no mask and no select (Triton cannot fill FP8 with a zero "other", and a select
    # after the load kept the tile in registers). The callers index only rows of the sequence's own pages
    # (a gather clamps its slots to its last token, a page tile to its last page: finite values), and the
    # rows past the length get probability 0 and scale 0, so they add 0.
    if fp8:
        return cache_ref[layer, rows, pl.ds(start, width)].astype(cdt)
    # Gathered rows in the interpreter: a select after the load (it has no masked gather).
    if interpret and not isinstance(rows, pl.Slice):
        x = cache_ref[layer, rows, pl.ds(start, width)].astype(cdt)
        return jnp.where(valid[:, None], x, jnp.zeros((), cdt))
    # Masked loads (zero fill) rather than a select after the load: the load then feeds the dots
    # directly, so Triton stages it asynchronously through shared memory instead of registers.
    lyr = jnp.int32(layer)  # an array index: the interpreter's masked load needs shapes
    return masked_load(cache_ref.at[lyr, rows, pl.ds(start, width)], valid[:, None]).astype(cdt)


def _mla_split_kernel(*refs, layer, C, R, block_size, block_t, split_len, scale, fp8, v_off, scale_col,
                      interpret):
    """Per-token gather tile: ``block_t`` token rows (slots through the block table, across pages) in
    one dot each for the scores and the values. Columns as in ``_mla_pages_kernel``."""
    if R:
        ql_ref, qr_ref, cache_ref, bt_ref, len_ref, o_ref, lse_ref = refs
    else:
        ql_ref, cache_ref, bt_ref, len_ref, o_ref, lse_ref = refs
    b = pl.program_id(2)
    s = pl.program_id(1)
    f32 = jnp.float32
    seq_len = len_ref[b]
    start = s * split_len
    n_tok = jnp.clip(seq_len - start, 0, split_len)
    n_tiles = (n_tok + block_t - 1) // block_t
    ql = ql_ref[...]  # [BH, C]
    qr = qr_ref[...] if R else None  # [BH, R]
    cdt = ql.dtype
    BH = ql.shape[0]
    offs = jnp.arange(block_t, dtype=jnp.int32)

    def body(i, carry):
        m, l, acc = carry
        t = start + i * block_t + offs  # [T] token positions
        valid = t < seq_len
        tc = jnp.minimum(t, seq_len - 1)  # rows past the length read the sequence's last token (masked below)
        slot = bt_ref[b, tc // block_size] * block_size + tc % block_size
        key = _load_rows(cache_ref, layer, slot, 0, C, valid, fp8, cdt, interpret)  # [T, C] gathered rows
        sc = jax.lax.dot_general(ql, key, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        if R:
            rop = _load_rows(cache_ref, layer, slot, C, R, valid, fp8, cdt, interpret)  # [T, R]
            sc = sc + jax.lax.dot_general(qr, rop, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        val = key if v_off is None else _load_rows(cache_ref, layer, slot, v_off, C, valid, fp8, cdt, interpret)
        if fp8:
            byte = jax.lax.bitcast_convert_type(cache_ref[layer, slot, scale_col], jnp.uint8)
            row_scale = jnp.where(valid, jnp.exp2(byte.astype(f32) - 127.0), 0.0)  # [T]
            sc = sc * (row_scale * scale)[None, :]
        else:
            sc = sc * scale
        sc = jnp.where(valid[None, :], sc, -jnp.inf)  # [BH, T]
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l_new = l * alpha + jnp.sum(p, axis=1)
        pv = p * row_scale[None, :] if fp8 else p
        acc = acc * alpha[:, None] + jnp.dot(pv.astype(cdt), val, preferred_element_type=f32)
        return m_new, l_new, acc

    _online_softmax(n_tiles, body, BH, C, o_ref, lse_ref)


def _mla_pages_kernel(*refs, layer, C, R, block_size, pages_per_tile, split_pages, scale, fp8, v_off,
                      scale_col, interpret):
    """Like ``_mla_split_kernel`` but a tile is ``pages_per_tile`` whole cache pages, each read as one
    contiguous [block_size, D] slab (a scalar page id, then a plain strided load: no per-token gather).

    Scores use cache columns [0, C) (plus [C, C+R) against q_rope when R > 0). Values are the same
    columns [0, C) (MLA: V is the latent) or, with ``v_off``, columns [v_off, v_off + C) (a plain
    K/V row such as Step3's MFA [k | v]). FP8 rows keep their scale byte at column ``scale_col``."""
    if R:
        ql_ref, qr_ref, cache_ref, bt_ref, len_ref, o_ref, lse_ref = refs
    else:
        ql_ref, cache_ref, bt_ref, len_ref, o_ref, lse_ref = refs
    b = pl.program_id(2)
    s = pl.program_id(1)
    f32 = jnp.float32
    seq_len = len_ref[b]
    page0 = s * split_pages
    n_pages = jnp.clip((seq_len + block_size - 1) // block_size - page0, 0, split_pages)
    n_tiles = (n_pages + pages_per_tile - 1) // pages_per_tile
    last_page = (seq_len - 1) // block_size
    ql = ql_ref[...]  # [BH, C]
    qr = qr_ref[...] if R else None  # [BH, R]
    cdt = ql.dtype
    BH = ql.shape[0]
    offs = jnp.arange(block_size, dtype=jnp.int32)

    def load(rows, start, width, valid):
        return _load_rows(cache_ref, layer, rows, start, width, valid, fp8, cdt, interpret)

    def body(i, carry):
        m, l, acc = carry
        parts = []
        for j in range(pages_per_tile):  # unrolled: independent loads in flight together
            p_idx = page0 + i * pages_per_tile + j
            valid = p_idx * block_size + offs < seq_len  # [bs]; split_pages % pages_per_tile == 0
            page = bt_ref[b, jnp.minimum(p_idx, last_page)]  # pages past the length: the last one (masked)
            rows = pl.ds(page * block_size, block_size)
            key = load(rows, 0, C, valid)  # [bs, C]
            sc = jax.lax.dot_general(ql, key, (((1,), (1,)), ((), ())), preferred_element_type=f32)
            if R:
                rop = load(rows, C, R, valid)  # [bs, R]
                sc = sc + jax.lax.dot_general(qr, rop, (((1,), (1,)), ((), ())), preferred_element_type=f32)
            val = key if v_off is None else load(rows, v_off, C, valid)
            if fp8:
                byte = jax.lax.bitcast_convert_type(cache_ref[layer, rows, scale_col], jnp.uint8)
                row_scale = jnp.where(valid, jnp.exp2(byte.astype(f32) - 127.0), 0.0)  # [bs]
                sc = sc * (row_scale * scale)[None, :]
            else:
                row_scale = None
                sc = sc * scale
            parts.append((jnp.where(valid[None, :], sc, -jnp.inf), val, row_scale))
        m_new = m
        for sc, _, _ in parts:
            m_new = jnp.maximum(m_new, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        l_new = l * alpha
        acc = acc * alpha[:, None]
        for sc, val, row_scale in parts:
            p = jnp.exp(sc - m_new[:, None])
            l_new = l_new + jnp.sum(p, axis=1)
            pv = p * row_scale[None, :] if fp8 else p
            acc = acc + jnp.dot(pv.astype(cdt), val, preferred_element_type=f32)
        return m_new, l_new, acc

    _online_softmax(n_tiles, body, BH, C, o_ref, lse_ref)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "layer", "v_offset", "block_h", "block_t",
                                             "num_splits", "num_warps", "num_stages", "tile", "out_dtype", "interpret"))
def paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, *, block_size: int, scale: float,
                      layer: int | None = None, v_offset: int | None = None, block_h: int = 16, block_t: int = 32,
                      num_splits: int = 1, num_warps: int = 4, num_stages: int = 2, tile: str = "gather",
                      out_dtype=None, interpret: bool | None = None):
    """q_latent [B, H, C], q_rope [B, H, R] or None, cache [num_slots, D] or [L, num_slots, D] (then
    ``layer`` picks one), block_tables [B, nb], seq_lens [B] (>= 1) -> context [B, H, C] float32.

    An FP8 cache (float8_e4m3fn) holds rows in the kv_quant layout. q_latent's dtype is the
    compute dtype of the dots (bf16 on GPU); accumulation and softmax are float32.
    ``tile="gather"`` reads ``block_t`` token rows per step through per-token slots;
    ``tile="pages"`` reads ``block_t // block_size`` whole pages per step, each as one slab.
    ``v_offset``: values are cache columns [v_offset, v_offset + C) instead of the
    key columns (MLA's V is its latent; a plain [k | v] row, e.g. Step3's MFA, has v_offset = C).
    ``out_dtype`` (default float32): the context's dtype; with one split the kernel writes it directly
    (at 128 heads x 512 sequences a float32 context and its cast cost ~0.1 ms a layer on the H100).
    """
    if tile not in ("gather", "pages"):
        raise ValueError(f"tile must be 'gather' or 'pages', got {tile!r}")
    if interpret is None:
        interpret = interpret_mode()
    if cache.ndim == 2:
        cache, layer = cache[None], 0
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    B, H, C = q_latent.shape
    R = 0 if q_rope is None else q_rope.shape[-1]
    nb = block_tables.shape[1]
    fp8 = jnp.dtype(cache.dtype) == jnp.dtype(FP8)
    Hp = pl.cdiv(H, block_h) * block_h
    pad = lambda x: x if Hp == H else jnp.pad(x, ((0, 0), (0, Hp - H), (0, 0)))  # noqa: E731 (zero queries, dropped)
    q_latent = pad(q_latent)
    qs = [q_latent] if not R else [q_latent, pad(q_rope.astype(q_latent.dtype))]
    max_len = nb * block_size
    kv_cols = C + R if v_offset is None else v_offset + C  # FP8: the scale byte follows the row's values
    if tile == "pages":
        ppt = max(1, block_t // block_size)
        split_pages = pl.cdiv(pl.cdiv(nb, num_splits), ppt) * ppt  # tiles never cross a split
        num_splits = pl.cdiv(nb, split_pages)
        kernel = functools.partial(_mla_pages_kernel, layer=layer, C=C, R=R, block_size=block_size,
                                   pages_per_tile=ppt, split_pages=split_pages, scale=float(scale), fp8=fp8,
                                   v_off=v_offset, scale_col=kv_cols, interpret=interpret)
    else:
        split_len = pl.cdiv(pl.cdiv(max_len, num_splits), block_t) * block_t
        num_splits = pl.cdiv(max_len, split_len)
        kernel = functools.partial(_mla_split_kernel, layer=layer, C=C, R=R, block_size=block_size,
                                   block_t=block_t, split_len=split_len, scale=float(scale), fp8=fp8,
                                   v_off=v_offset, scale_col=kv_cols, interpret=interpret)
    grid = (Hp // block_h, num_splits, B)
    whole = pl.no_block_spec  # whole arrays, indexed by hand in the kernel
    o, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((None, block_h, q.shape[-1]), lambda h, s, b: (b, h, 0)) for q in qs]
        + [whole, whole, whole],
        out_specs=[
            pl.BlockSpec((None, None, block_h, C), lambda h, s, b: (b, s, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda h, s, b: (b, s, h)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, num_splits, Hp, C), out_dtype if num_splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((B, num_splits, Hp), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="mla_decode_split",
    )(*qs, cache, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32))
    return combine_splits(o, lse, out_dtype)[:, :H]


def layered_cache(cache, layer, block_tables, batch: int):
    """The decode kernels' shared argument checks: block_tables [batch, nb]; cache [slots, D] (taken as layer
    0 of [1, slots, D]) or [L, slots, D] with ``layer`` in range -> (cache [L, slots, D], layer)."""
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [B={batch}, nb], got {block_tables.shape}")
    if cache.ndim == 2:
        cache, layer = cache[None], 0
    if layer is None:
        raise ValueError("layer: a [L, slots, D] cache needs the layer index")
    if not 0 <= layer < cache.shape[0]:
        raise ValueError(f"layer: {layer} is outside the cache's {cache.shape[0]} layers")
    return cache, layer


def combine_splits(o, lse, out_dtype):
    """Stage 2 of flash-decoding (plain JAX, fused by XLA): the splits' normalised contexts o [B, S, H, C]
    weighted by exp(lse_s - lse_max) (lse [B, S, H], natural log, -inf for a split that saw no token)."""
    if o.shape[1] == 1:
        return o[:, 0]
    lmax = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(lmax), lmax, 0.0))  # [B, S, H]; empty splits weigh 0
    return (jnp.einsum("bsh,bshc->bhc", w, o) / jnp.sum(w, axis=1)[..., None]).astype(out_dtype)
