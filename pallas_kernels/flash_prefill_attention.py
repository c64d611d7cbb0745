"""Causal flash attention for prefill, MLA and MFA (Pallas, Triton backend).

No score tensor is ever stored: each program keeps one query tile in registers, walks the
keys it may see in tiles and keeps an online softmax (float32 max, sum and accumulator),
so memory is the inputs and outputs alone.

One kernel serves both attention shapes of the engine:

- DeepSeek MLA, expanded form: per head a 128-dim "nope" query/key and a 64-dim rope
  query against ONE rope key shared by every head (``q_rope`` / ``k_rope``); 128-dim values.
  The 192-dim score is two dots (nope and rope), each of Triton-friendly width.
- Step3 MFA (and any GQA): ``Hk`` K/V heads, each shared by ``g = H / Hk`` query heads
  (one 256-dim K/V head for all 64 query heads in Step3). Queries are laid out as rows
  (token, head-in-group), so one tile of ``block_q`` rows holds ``block_q / g`` tokens x g
  heads and every K/V tile a program loads serves all of them (read once per head block).

Keys and values come in one array ``kv [B, Tk, Hk, W]``: keys are columns [0, Dk), values
columns [v_offset, v_offset + Dv). That is MLA's kv_b_proj output ([k_nope | v] per head)
and MFA's cache row ([k | v]) as they are, with no slicing copies.

Positions. Sequence b has ``seq_lens[b]`` queries, the LAST ones of a context of
``ctx_lens[b]`` tokens: query i sits at position ``ctx_lens[b] - seq_lens[b] + i``. Key j of
``kv`` sits at position ``kv_start[b] + j`` (0 for a whole context; a segment of a longer
context otherwise). Query i sees key j iff key position <= query position and key position
< ctx_lens[b]. One-shot prefill is ctx_lens = seq_lens; a chunk after a cached prefix has
ctx_lens = prefix + chunk. Rows past seq_lens come back as zeros (log-sum-exp -inf), as do
queries that see no key of this ``kv`` (a segment entirely in their future).

The programs' grid is (row blocks, K/V heads, batch), row blocks fastest and the latest
(longest) ones first, so the programs sharing one head's keys run together (L2 reuse) and
the heaviest start first. Each program walks the key tiles that lie entirely in the past of
all its rows without a mask, then the diagonal / ragged tail with one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import compiler_params, interpret_mode

LOG2E = math.log2(math.e)


def _prefill_kernel(*refs, group, block_q, block_k, Dk, Dv, R, v_off, n_row_blocks, Tk, scale):
    if R:
        q_ref, qr_ref, kv_ref, kr_ref, qlen_ref, ctx_ref, k0_ref, o_ref, lse_ref = refs
    else:
        q_ref, kv_ref, qlen_ref, ctx_ref, k0_ref, o_ref, lse_ref = refs
        qr_ref = kr_ref = None
    f32 = jnp.float32
    i = n_row_blocks - 1 - pl.program_id(0)  # latest rows first: the longest programs start first
    b = pl.program_id(2)
    q_len, ctx, k0 = qlen_ref[b], ctx_ref[b], k0_ref[b]
    q0 = ctx - q_len  # position of query 0
    kv_len = jnp.clip(ctx - k0, 0, Tk)  # keys of this array inside the context
    rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    qpos = q0 + rows // group  # [bq]
    first_tok = (i * block_q) // group
    last_tok = jnp.minimum((i * block_q + block_q - 1) // group, q_len - 1)
    # keys [0, hi) are visited; those in [0, full * block_k) are in every row's past (no mask)
    hi = jnp.where(first_tok < q_len, jnp.clip(jnp.minimum(kv_len, q0 + last_tok - k0 + 1), 0, Tk), 0)
    n_blocks = (hi + block_k - 1) // block_k
    full = jnp.clip(jnp.minimum(kv_len, q0 + first_tok - k0 + 1) // block_k, 0, n_blocks)

    q = q_ref[...]  # [bq, Dk]
    qr = qr_ref[...] if R else None  # [bq, R]
    cdt = q.dtype
    qk_scale = scale * LOG2E  # exp2 domain
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry, masked: bool):
        m, l, acc = carry
        ks = pl.ds(j * block_k, block_k)
        k = kv_ref[ks, pl.ds(0, Dk)]  # [bk, Dk]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        if R:
            kr = kr_ref[ks, :]  # [bk, R]: one rope key for every head
            s = s + jax.lax.dot_general(qr, kr, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        s = s * qk_scale
        if masked:
            kj = j * block_k + offs  # relative key index
            ok = (kj[None, :] < kv_len) & (k0 + kj[None, :] <= qpos[:, None])
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l * alpha + jnp.sum(p, axis=1)
        v = kv_ref[ks, pl.ds(v_off, Dv)]  # [bk, Dv]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(cdt), v, preferred_element_type=f32)
        return m_new, l_new, acc

    # m starts finite (not -inf) so that exp2(m - m_new) never sees inf - inf on fully masked rows.
    init = (jnp.full((block_q,), -1e30, f32), jnp.zeros((block_q,), f32), jnp.zeros((block_q, Dv), f32))
    carry = jax.lax.fori_loop(0, full, functools.partial(body, masked=False), init)
    m, l, acc = jax.lax.fori_loop(full, n_blocks, functools.partial(body, masked=True), carry)
    has = (l > 0) & (rows // group < q_len)  # rows past seq_lens: zeros
    safe = jnp.where(has, l, 1.0)
    o_ref[...] = jnp.where(has[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m + jnp.log2(safe)) / LOG2E, -jnp.inf)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.partial(jax.jit, static_argnames=("scale", "v_offset", "v_dim", "block_q", "block_k", "num_warps",
                                             "num_stages", "out_dtype", "return_lse", "interpret"))
def flash_prefill_attention(q, kv, seq_lens, ctx_lens=None, kv_start=None, *, scale: float, q_rope=None,
                            k_rope=None, v_offset: int | None = None, v_dim: int | None = None, block_q: int = 64,
                            block_k: int = 64, num_warps: int = 4, num_stages: int = 2, out_dtype=jnp.float32,
                            return_lse: bool = False, interpret: bool | None = None):
    """Causal attention of the last ``seq_lens`` positions of each context (no score tensor).

    q [B, Tq, H, Dk]; kv [B, Tk, Hk, W] with keys in columns [0, Dk) and values in
    [v_offset, v_offset + Dv) (default: v_offset = Dk, Dv = v_dim or Dk); H a multiple of Hk.
    q_rope [B, Tq, H, R] and k_rope [B, Tk, R] (one rope key for all heads; MLA) or None.
    seq_lens [B] queries per sequence, ctx_lens [B] (default seq_lens) context lengths,
    kv_start [B] (default 0) position of kv's key 0 (module docstring: positions).
    -> out [B, Tq, H, Dv] (out_dtype), and with ``return_lse`` the log-sum-exp [B, Tq, H]
    float32 (natural log; -inf where a query saw no key), for merging segments.

    Operands share q's dtype (Triton dots take equal dtypes); scores, softmax and the
    accumulation are float32. ``block_q``: rows of a query tile (tokens x heads of one K/V
    group); ``block_k``: keys per step. On a GPU, Dk, R, Dv, block_q and block_k must be
    powers of two >= 16; the interpreter (CPU) takes any."""
    if interpret is None:
        interpret = interpret_mode()
    B, Tq, H, Dk = q.shape
    _, Tk, Hk, W = kv.shape
    if H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of K/V heads ({Hk})")
    g = H // Hk
    v_off = Dk if v_offset is None else v_offset
    Dv = v_dim or Dk
    if v_off + Dv > W or Dk > W:
        raise ValueError(f"kv rows of width {W} cannot hold keys [0, {Dk}) and values [{v_off}, {v_off + Dv})")
    R = 0 if q_rope is None else q_rope.shape[-1]
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope come together")
    cdt = q.dtype
    seq_lens = seq_lens.astype(jnp.int32)
    ctx_lens = seq_lens if ctx_lens is None else ctx_lens.astype(jnp.int32)
    kv_start = jnp.zeros((B,), jnp.int32) if kv_start is None else jnp.broadcast_to(kv_start, (B,)).astype(jnp.int32)

    def rows(x):  # [B, Tq, H, D] -> [B, Tq * g, Hk, D]: row = (token, head in its K/V group)
        x = x.reshape(B, Tq, Hk, g, x.shape[-1])
        if Hk > 1 and g > 1:
            x = x.transpose(0, 2, 1, 3, 4)
            return x.reshape(B, Hk, Tq * g, -1).transpose(0, 2, 1, 3)
        return x.transpose(0, 1, 3, 2, 4).reshape(B, Tq * g, Hk, -1)

    M = Tq * g
    Mp, Tkp = _round_up(M, block_q), _round_up(Tk, block_k)
    pad_rows = lambda x: x if Mp == M else jnp.pad(x, ((0, 0), (0, Mp - M)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    pad_keys = lambda x: x if Tkp == Tk else jnp.pad(x, ((0, 0), (0, Tkp - Tk)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    qs = [pad_rows(rows(q))]
    if R:
        qs.append(pad_rows(rows(q_rope.astype(cdt))))
    kvs = [pad_keys(kv.astype(cdt))] + ([pad_keys(k_rope.astype(cdt))] if R else [])
    nrb = Mp // block_q
    rev = lambda i: nrb - 1 - i  # noqa: E731  (the kernel walks row blocks latest first)
    in_specs = [pl.BlockSpec((None, block_q, None, x.shape[-1]), lambda i, h, b: (b, rev(i), h, 0)) for x in qs]
    in_specs.append(pl.BlockSpec((None, Tkp, None, W), lambda i, h, b: (b, 0, h, 0)))
    if R:
        in_specs.append(pl.BlockSpec((None, Tkp, R), lambda i, h, b: (b, 0, 0)))
    whole = pl.no_block_spec
    kernel = functools.partial(_prefill_kernel, group=g, block_q=block_q, block_k=block_k, Dk=Dk, Dv=Dv, R=R,
                               v_off=v_off, n_row_blocks=nrb, Tk=Tk, scale=float(scale))
    o, lse = pl.pallas_call(
        kernel,
        grid=(nrb, Hk, B),
        in_specs=in_specs + [whole, whole, whole],
        out_specs=[pl.BlockSpec((None, block_q, None, Dv), lambda i, h, b: (b, rev(i), h, 0)),
                   pl.BlockSpec((None, block_q, None), lambda i, h, b: (b, rev(i), h))],
        out_shape=[jax.ShapeDtypeStruct((B, Mp, Hk, Dv), out_dtype),
                   jax.ShapeDtypeStruct((B, Mp, Hk), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_prefill_attention",
    )(*qs, *kvs, seq_lens, ctx_lens, kv_start)

    def unrows(x):  # [B, Mp, Hk, ...] -> [B, Tq, H, ...]
        x = x[:, :M]
        tail = x.shape[3:]
        if Hk > 1 and g > 1:
            x = x.transpose(0, 2, 1, *range(3, x.ndim)).reshape(B, Hk, Tq, g, *tail)
            return x.transpose(0, 2, 1, 3, *range(4, x.ndim)).reshape(B, Tq, H, *tail)
        x = x.reshape(B, Tq, g, Hk, *tail)
        return jnp.swapaxes(x, 2, 3).reshape(B, Tq, H, *tail)

    out = unrows(o)
    return (out, unrows(lse)) if return_lse else out
