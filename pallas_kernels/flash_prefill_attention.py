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

Keys and values come in one array ``kv``: keys are columns [0, Dk), values columns
[v_offset, v_offset + Dv). That is MLA's kv_b_proj output ([k_nope | v] per head) and MFA's
cache row ([k | v]) as they are, with no slicing copies.

And it takes the sequences in either of two layouts:

- Batched (``flash_prefill_attention``): q [B, Tq, H, Dk], kv [B, Tk, Hk, W], each sequence
  padded to Tq / Tk. Sequence b has ``seq_lens[b]`` queries, the LAST ones of a context of
  ``ctx_lens[b]`` tokens: query i sits at position ``ctx_lens[b] - seq_lens[b] + i``. Key j of
  ``kv`` sits at position ``kv_start[b] + j`` (0 for a whole context; a segment of a longer
  context otherwise). Query i sees key j iff key position <= query position and key position
  < ctx_lens[b]. One-shot prefill is ctx_lens = seq_lens; a chunk after a cached prefix has
  ctx_lens = prefix + chunk. Rows past seq_lens come back as zeros (log-sum-exp -inf), as do
  queries that see no key of this ``kv`` (a segment entirely in their future). Grid (row
  blocks, K/V heads, batch), row blocks fastest and the latest (longest) ones first, so the
  programs sharing one head's keys run together (L2 reuse) and the heaviest start first.
- Packed (``flash_packed_prefill_attention``; vLLM / SGLang's varlen form): whole prompts back
  to back in one token stream, q [T, H, Dk], kv [T, Hk, W], sequence b the tokens
  [cu_seqlens[b], cu_seqlens[b + 1]), each attending causally to its own tokens. Nothing is
  padded to the longest prompt and the stream needs no alignment: the grid runs over row
  blocks of the sequences (sequence b has ceil(len_b * g / block_q) of them, the last one
  partly idle), listed by a small int32 table (block -> sequence, block within it) built from
  cu_seqlens with jnp and ordered heaviest first. A program reads its sequence's start from
  cu_seqlens and loads its query tile and key tiles from the whole stream at that offset
  (``pl.ds``: the contiguous axis is the feature axis, so an unaligned token offset costs no
  vectorisation); tiles reaching past the sequence are masked by its length and causality.
  The output comes back in the stream's layout; tokens past cu_seqlens[B] are zeros.

Each program walks the key tiles that lie entirely in the past of all its rows without a
mask, then the diagonal / ragged tail with one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import compiler_params, interpret_mode

LOG2E = math.log2(math.e)


def _prefill_kernel(*refs, packed, group, block_q, block_k, Dk, Dv, R, v_off, n_row_blocks, q_rows, Tk, scale):
    if R:
        q_ref, qr_ref, kv_ref, kr_ref, *rest = refs
    else:
        q_ref, kv_ref, *rest = refs
        qr_ref = kr_ref = None
    f32 = jnp.float32
    if packed:
        # q_ref / kv_ref hold the whole stream of one K/V head; the table says whose block this is.
        cu_ref, seq_ref, blk_ref, o_ref, lse_ref = rest
        prog = pl.program_id(0)
        b, i = seq_ref[prog], blk_ref[prog]
        k_base = cu_ref[b]  # the sequence's first token in the stream
        q_len = cu_ref[b + 1] - k_base
        ctx, k0 = q_len, 0
        qs = pl.ds(jnp.minimum(k_base * group + i * block_q, q_rows - block_q), block_q)
        q = q_ref[qs, :]  # [bq, Dk]
        qr = qr_ref[qs, :] if R else None  # [bq, R]
    else:
        qlen_ref, ctx_ref, k0_ref, o_ref, lse_ref = rest
        i = n_row_blocks - 1 - pl.program_id(0)  # latest rows first: the longest programs start first
        b = pl.program_id(2)
        q_len, ctx, k0 = qlen_ref[b], ctx_ref[b], k0_ref[b]
        k_base = 0
        q = q_ref[...]  # [bq, Dk]
        qr = qr_ref[...] if R else None  # [bq, R]
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

    cdt = q.dtype
    qk_scale = scale * LOG2E  # exp2 domain
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry, masked: bool):
        m, l, acc = carry
        ks = pl.ds(k_base + j * block_k, block_k)
        k = kv_ref[ks, pl.ds(0, Dk)]  # [bk, Dk]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        if R:
            kr = kr_ref[ks, :]  # [bk, R]: one rope key for every head
            s = s + jax.lax.dot_general(qr, kr, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        s = s * qk_scale
        if masked:
            kj = j * block_k + offs  # key index relative to the sequence's keys
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
    has = (l > 0) & (rows // group < q_len)  # rows past the sequence's queries: zeros
    safe = jnp.where(has, l, 1.0)
    o_ref[...] = jnp.where(has[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m + jnp.log2(safe)) / LOG2E, -jnp.inf)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _layout(q, kv, q_rope, k_rope, v_offset, v_dim):
    """(K/V heads, group size, value column, value width, rope width), checking the arguments."""
    H, Dk = q.shape[-2:]
    Hk, W = kv.shape[-2:]
    if H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of K/V heads ({Hk})")
    v_off = Dk if v_offset is None else v_offset
    Dv = v_dim or Dk
    if v_off + Dv > W or Dk > W:
        raise ValueError(f"kv rows of width {W} cannot hold keys [0, {Dk}) and values [{v_off}, {v_off + Dv})")
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope come together")
    return Hk, H // Hk, v_off, Dv, 0 if q_rope is None else q_rope.shape[-1]


def _to_rows(x, Hk, g):
    """[B, T, H, D] -> [B, T * g, Hk, D]: row = (token, head in its K/V group)."""
    B, T = x.shape[:2]
    x = x.reshape(B, T, Hk, g, x.shape[-1])
    if Hk > 1 and g > 1:
        x = x.transpose(0, 2, 1, 3, 4)
        return x.reshape(B, Hk, T * g, -1).transpose(0, 2, 1, 3)
    return x.transpose(0, 1, 3, 2, 4).reshape(B, T * g, Hk, -1)


def _from_rows(x, T, Hk, g):
    """[B, T * g, Hk, ...] -> [B, T, H, ...] (the inverse of _to_rows)."""
    B, tail = x.shape[0], x.shape[3:]
    if Hk > 1 and g > 1:
        x = x.transpose(0, 2, 1, *range(3, x.ndim)).reshape(B, Hk, T, g, *tail)
        return x.transpose(0, 2, 1, 3, *range(4, x.ndim)).reshape(B, T, Hk * g, *tail)
    x = x.reshape(B, T, g, Hk, *tail)
    return jnp.swapaxes(x, 2, 3).reshape(B, T, Hk * g, *tail)


def _pad_axis(x, n, axis):
    return x if x.shape[axis] == n else jnp.pad(x, [(0, n - x.shape[axis]) if a == axis else (0, 0)
                                                   for a in range(x.ndim)])


_STATIC = ("scale", "v_offset", "v_dim", "block_q", "block_k", "num_warps", "num_stages", "out_dtype", "return_lse",
           "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
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
    Tk, W = kv.shape[1], kv.shape[3]
    Hk, g, v_off, Dv, R = _layout(q, kv, q_rope, k_rope, v_offset, v_dim)
    cdt = q.dtype
    seq_lens = seq_lens.astype(jnp.int32)
    ctx_lens = seq_lens if ctx_lens is None else ctx_lens.astype(jnp.int32)
    kv_start = jnp.zeros((B,), jnp.int32) if kv_start is None else jnp.broadcast_to(kv_start, (B,)).astype(jnp.int32)

    M = Tq * g
    Mp, Tkp = _round_up(M, block_q), _round_up(Tk, block_k)
    qs = [_pad_axis(_to_rows(q, Hk, g), Mp, 1)]
    if R:
        qs.append(_pad_axis(_to_rows(q_rope.astype(cdt), Hk, g), Mp, 1))
    kvs = [_pad_axis(kv.astype(cdt), Tkp, 1)] + ([_pad_axis(k_rope.astype(cdt), Tkp, 1)] if R else [])
    nrb = Mp // block_q
    rev = lambda i: nrb - 1 - i  # noqa: E731  (the kernel walks row blocks latest first)
    in_specs = [pl.BlockSpec((None, block_q, None, x.shape[-1]), lambda i, h, b: (b, rev(i), h, 0)) for x in qs]
    in_specs.append(pl.BlockSpec((None, Tkp, None, W), lambda i, h, b: (b, 0, h, 0)))
    if R:
        in_specs.append(pl.BlockSpec((None, Tkp, R), lambda i, h, b: (b, 0, 0)))
    whole = pl.no_block_spec
    kernel = functools.partial(_prefill_kernel, packed=False, group=g, block_q=block_q, block_k=block_k, Dk=Dk, Dv=Dv,
                               R=R, v_off=v_off, n_row_blocks=nrb, q_rows=Mp, Tk=Tk, scale=float(scale))
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
    out = _from_rows(o[:, :M], Tq, Hk, g)
    return (out, _from_rows(lse[:, :M], Tq, Hk, g)) if return_lse else out


def check_packed(q, kv, cu_seqlens) -> None:
    """The packed form's shapes: q [T, H, Dk], kv [T, Hk, W], cu_seqlens [B + 1]."""
    if q.ndim != 3 or kv.ndim != 3:
        raise ValueError(f"packed q must be [T, H, Dk] and kv [T, Hk, W], got q {q.shape} and kv {kv.shape}")
    if kv.shape[0] != q.shape[0]:
        raise ValueError(f"kv holds {kv.shape[0]} tokens, q {q.shape[0]}: the packed stream is one token axis")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [B + 1] with B >= 1, got shape {cu_seqlens.shape}")


def packed_row_blocks(cu_seqlens, T: int, group: int, block_q: int):
    """The packed grid's table: which (sequence, row block within it) each program computes,
    heaviest first, and where each row of the stream lands in the kernel's output.

    cu_seqlens [B + 1]; T tokens of the stream; rows = T * group. Returns (seq [P], block [P],
    dst [T * group]) for P = ceil(T * group / block_q) + B programs (an upper bound on the
    sequences' blocks: each sequence's last block may be partly empty). Programs past the
    sequences' blocks get block index P, past every sequence's rows: they compute nothing.
    dst[r] is the output row of stream row r (rows past cu_seqlens[B] point at row 0)."""
    B = cu_seqlens.shape[0] - 1
    P = -(-T * group // block_q) + B
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    n_blk = (lens * group + block_q - 1) // block_q
    ends = jnp.cumsum(n_blk)
    first = ends - n_blk
    idx = jnp.arange(P, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)  # B past the last block
    live = seq < B
    seq = jnp.minimum(seq, B - 1)
    blk = jnp.where(live, idx - first[seq], P)
    # The heaviest blocks (furthest into their sequence: most keys) start first.
    work = jnp.where(live, jnp.minimum((blk + 1) * block_q // group, lens[seq]), -1)
    order = jnp.argsort(-work, stable=True)
    program_of = jnp.zeros((P,), jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))
    t = jnp.arange(T, dtype=jnp.int32)
    tok_seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), B - 1).astype(jnp.int32)
    local = ((t - cu[tok_seq]) * group)[:, None] + jnp.arange(group, dtype=jnp.int32)  # [T, g] rows in the sequence
    prog = program_of[jnp.clip(first[tok_seq][:, None] + local // block_q, 0, P - 1)]
    dst = jnp.where((t < cu[B])[:, None], prog * block_q + local % block_q, 0).reshape(T * group)
    return seq[order], blk[order], dst


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_packed_prefill_attention(q, kv, cu_seqlens, *, scale: float, q_rope=None, k_rope=None,
                                   v_offset: int | None = None, v_dim: int | None = None, block_q: int = 64,
                                   block_k: int = 64, num_warps: int = 4, num_stages: int = 2,
                                   out_dtype=jnp.float32, return_lse: bool = False, interpret: bool | None = None):
    """Causal self-attention of whole prompts packed back to back in one token stream.

    q [T, H, Dk]; kv [T, Hk, W] (keys columns [0, Dk), values [v_offset, v_offset + Dv));
    q_rope [T, H, R] / k_rope [T, R] (one rope key for all heads; MLA) or None;
    cu_seqlens [B + 1] int32: sequence b is the tokens [cu_seqlens[b], cu_seqlens[b + 1]), at
    positions 0, 1, ... (nondecreasing, cu_seqlens[0] = 0, cu_seqlens[B] <= T; empty sequences
    allowed). -> out [T, H, Dv] (and the log-sum-exp [T, H] with ``return_lse``); tokens past
    cu_seqlens[B] come back as zeros (log-sum-exp -inf). Block sizes and dtypes as
    ``flash_prefill_attention``."""
    if interpret is None:
        interpret = interpret_mode()
    check_packed(q, kv, cu_seqlens)
    T, H, Dk = q.shape
    Hk, g, v_off, Dv, R = _layout(q, kv, q_rope, k_rope, v_offset, v_dim)
    W = kv.shape[-1]
    cdt = q.dtype
    seq, blk, dst = packed_row_blocks(cu_seqlens, T, g, block_q)
    P = seq.shape[0]
    # Rows and keys padded by one tile at the end: a tile starting at the stream's last row stays in bounds.
    Mq, Tkp = _round_up(T * g, block_q) + block_q, _round_up(T, block_k) + block_k
    qs = [_pad_axis(_to_rows(q[None], Hk, g)[0], Mq, 0)]
    if R:
        qs.append(_pad_axis(_to_rows(q_rope[None].astype(cdt), Hk, g)[0], Mq, 0))
    kvs = [_pad_axis(kv.astype(cdt), Tkp, 0)] + ([_pad_axis(k_rope.astype(cdt), Tkp, 0)] if R else [])
    in_specs = [pl.BlockSpec((Mq, None, x.shape[-1]), lambda p, h: (0, h, 0)) for x in qs]
    in_specs.append(pl.BlockSpec((Tkp, None, W), lambda p, h: (0, h, 0)))
    if R:
        in_specs.append(pl.BlockSpec((Tkp, R), lambda p, h: (0, 0)))
    whole = pl.no_block_spec
    kernel = functools.partial(_prefill_kernel, packed=True, group=g, block_q=block_q, block_k=block_k, Dk=Dk, Dv=Dv,
                               R=R, v_off=v_off, n_row_blocks=P, q_rows=Mq, Tk=T, scale=float(scale))
    o, lse = pl.pallas_call(
        kernel,
        grid=(P, Hk),
        in_specs=in_specs + [whole, whole, whole],
        out_specs=[pl.BlockSpec((block_q, None, Dv), lambda p, h: (p, h, 0)),
                   pl.BlockSpec((block_q, None), lambda p, h: (p, h))],
        out_shape=[jax.ShapeDtypeStruct((P * block_q, Hk, Dv), out_dtype),
                   jax.ShapeDtypeStruct((P * block_q, Hk), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_packed_prefill_attention",
    )(*qs, *kvs, cu_seqlens.astype(jnp.int32), seq, blk)
    real = (jnp.arange(T * g) // g < cu_seqlens[-1])[:, None]  # rows of padding tokens: zeros
    o = jnp.where(real[..., None], o[dst], 0).astype(out_dtype)
    out = _from_rows(o[None], T, Hk, g)[0]
    return (out, _from_rows(jnp.where(real, lse[dst], -jnp.inf)[None], T, Hk, g)[0]) if return_lse else out
