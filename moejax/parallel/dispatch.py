"""MoE dispatch/combine backends (run inside ``jax.shard_map`` over the EP axis).

All share one contract: given this rank's tokens ``x`` [T, H], their logical
expert choices ``topk_idx``/``topk_weight`` [T, k], which tokens are real
(``valid`` [T]; padding rows are never sent), the placement tables
(``slots`` [E, max_replicas]: the physical slots of each logical expert,
``replicas`` [E]) and this rank's expert weights ([E_local, ...]), return
(the weighted sum of the chosen experts' outputs for each local token, float32
[T, H]; the number of (token, expert) pairs this rank's experts computed).
With ``shared`` (SharedWeights, replicated on every rank) the shared experts run in
the same grouped computation as this rank's routed experts, on this rank's own
tokens only (never dispatched), and their outputs are added with weight 1; they
are no slot of the placement tables and are not counted in the pairs.
Physical slot s lives on rank s // E_local. Shapes are static and no
token is dropped, whatever the routing. A token routed to an expert with several
replicas goes to replica ``source_rank % replicas``: with balanced data-parallel
batches the replicas share the load evenly, and the split is exactly predictable
from per-rank counts.

- ``a2a`` (every platform): each token is sent at most once to each rank that
  owns one of its experts (buffers [ranks, T, H]: the worst case, every token
  to every rank, fits), the receiver applies all of that token's local experts
  and sends one partial sum back; ``jax.lax.all_to_all`` both ways, one each way
  (the expert ids and weights travel as raw bits in the rows' buffer).
- ``ragged`` (GPU): the same exchange with ``jax.lax.ragged_all_to_all``,
  sending only the rows that exist. XLA:CPU does not implement it.
- ``ffi``: the same exchange as ``a2a`` through the XLA FFI extension's dispatch and
  combine custom calls (ffi/, docs/ffi.md), the implementation chosen by platform:
  host on CPU (the contract's reference, run in CI), MoRI on ROCm; receives only
  the rows that exist, at a static worst-case capacity [ranks * T, H].
- ``replicated``: tokens all-gathered, each rank computes its experts for every
  token, partial sums reduce-scattered back (small decode batches).
- ``local``: no mesh; all experts on this device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.kernels import common
from moejax.layers.experts import SharedWeights, grouped_expert_mlp
from moejax.parallel import ffi_ops  # the extension itself is loaded only when the ffi backend is chosen

BACKENDS = ("a2a", "ragged", "replicated", "ffi")


DBO_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How a model's routed experts are reached: ``local`` (no mesh) or a backend over ``axis``;
    and whether a step runs as two micro-batches (dual-batch overlap, ``micro_batches``)."""
    backend: str = "local"
    axis: str | None = None
    n_ranks: int = 1
    num_redundant: int = 0  # extra physical slots for replicas of hot experts (EPLB)
    dbo: str = "off"  # "auto": by tokens per rank (below); "on"/"off": always / never
    dbo_decode_min_tokens: int = 64
    dbo_prefill_min_tokens: int = 512

    def micro_batches(self, tokens_per_rank: int, phase: str) -> int:
        """2 where the step's rank batch is split so one micro-batch's dispatch/combine runs under the
        other's compute, else 1. Decided from static shapes at trace time, so every rank of a step
        (one program) takes the same choice. "auto" needs a collective to hide (more than one rank)
        and at least the phase's threshold of tokens per rank: below it the split's smaller GEMMs and
        extra launches cost more than the hidden all-to-all (SGLang: -27% at 32 decode tokens per GPU,
        +25% at 256; vLLM switches on above 32 decode and 512 prefill tokens per rank)."""
        if tokens_per_rank < 2 or self.dbo == "off":
            return 1
        if self.dbo == "on":
            return 2
        least = self.dbo_decode_min_tokens if phase == "decode" else self.dbo_prefill_min_tokens
        return 2 if self.n_ranks > 1 and self.backend != "local" and tokens_per_rank >= least else 1


def physical_slots(topk_idx, slots, replicas, source_rank):
    """[T, k] logical experts -> physical slots; a replicated expert serves rank r's tokens from replica r % n."""
    src = jnp.broadcast_to(jnp.asarray(source_rank).reshape(-1, 1), topk_idx.shape)
    return jnp.take_along_axis(slots[topk_idx], (src % replicas[topk_idx])[..., None], axis=-1)[..., 0]


def _apply_local_experts(x, local_ids, weights, w, shared: SharedWeights | None = None, x_own=None):
    """x [M, H]; local_ids/weights [M, k], id -1 = not on this rank. With ``shared``: the shared experts
    run in the same grouped computation on ``x_own`` [T, H] (this rank's own tokens: shared experts are
    never dispatched), appended as S extra groups of weight 1 after the routed ones.
    Returns (routed [M, H] float32, shared [T, H] float32 or None, (token, routed expert) pairs computed)."""
    M, k = local_ids.shape
    E_loc = w.num_experts
    S = 0 if shared is None else shared.num_experts
    valid = local_ids >= 0
    key = jnp.where(valid, local_ids, E_loc + S).reshape(-1)  # invalid entries sort last, outside every group
    src, wts, ok, rows = jnp.arange(M * k) // k, weights.reshape(-1), valid.reshape(-1), x
    if S:
        T = x_own.shape[0]
        key = jnp.concatenate([key, jnp.repeat(E_loc + jnp.arange(S, dtype=key.dtype), T)])
        src = jnp.concatenate([src, M + jnp.tile(jnp.arange(T), S)])
        wts = jnp.concatenate([wts, jnp.ones((S * T,), wts.dtype)])
        ok = jnp.concatenate([ok, jnp.ones((S * T,), bool)])
        rows = jnp.concatenate([x, x_own.astype(x.dtype)])
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=E_loc + S + 1)[:E_loc + S].astype(jnp.int32)
    row = src[order]
    y = grouped_expert_mlp(rows[row], group_sizes, w, shared)
    ok = ok[order]
    wt = jnp.where(ok, wts[order], 0.0)
    y = jnp.where(ok[:, None], y * wt[:, None], 0.0)  # rows outside the groups are unspecified
    out = jnp.zeros((rows.shape[0], x.shape[-1]), jnp.float32).at[row].add(y)
    return out[:M], (out[M:] if S else None), group_sizes[:E_loc].sum()


def _plus(y, shared_y):
    return y if shared_y is None else y + shared_y


# XLA:CPU: at most this many experts run dense (every token through every expert, E / k times the
# routed FLOPs, small at the sizes run on a CPU): the grouped path's sort, gathers and scatter-add (while
# loops there) are a third to a half of a tiny MoE layer's compile (BENCHMARKS.md 2026-12-07e start-up (CPU)).
DENSE_CPU_MAX_EXPERTS = 64


def dense_on_cpu(w, shared) -> bool:
    """Whether ``local_experts`` computes every expert for every token (XLA:CPU, few bf16/f32 experts, the
    shared experts beside them) instead of the grouped path."""
    return (common.platform() == "cpu" and w.gate_scale is None and shared is None
            and w.num_experts <= DENSE_CPU_MAX_EXPERTS)


def _dense_local_experts(x, ids, topk_weight, w):
    """The grouped path's sum, each token through all E experts weighted by its (id, weight) choices
    (weight 0 for the others and for padding): [T, H] float32, and the (token, expert) pairs chosen."""
    f32 = jnp.float32
    comb = (jax.nn.one_hot(ids, w.num_experts, dtype=f32) * topk_weight[..., None].astype(f32)).sum(1)  # [T, E]
    g = common.einsum_f32("th,ehi->tei", x, w.gate)
    u = common.einsum_f32("th,ehi->tei", x, w.up)
    h = (jax.nn.silu(g) * u).astype(x.dtype)  # the grouped path's rounding before the down projection
    y = common.einsum_f32("tei,eih->teh", h, w.down)
    return jnp.einsum("teh,te->th", y, comb), (ids >= 0).sum().astype(jnp.int32)


def local_experts(x, topk_idx, topk_weight, valid, slots, replicas, w, shared=None):
    ids = jnp.where(valid[:, None], physical_slots(topk_idx, slots, replicas, 0), -1)
    if dense_on_cpu(w, shared):
        return _dense_local_experts(x, ids, topk_weight, w)
    y, ys, n = _apply_local_experts(x, ids, topk_weight, w, shared, x)
    return _plus(y, ys), n


def _route(topk_idx, valid, slots, replicas, E_loc, source_rank):
    s = physical_slots(topk_idx, slots, replicas, source_rank)
    rank = jnp.where(valid[:, None], s // E_loc, -1)  # padding goes nowhere
    return rank, s % E_loc  # rank, expert index on that rank


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _pack(x, ids, wts):
    """One unsigned-integer buffer [..., H + 2 k * 4 / itemsize] of x's width: the rows' bits, then each
    row's expert ids (int32) and weights (float32) as raw bits, so one collective moves all three.
    Integers, not x's float type, carry the words: XLA may compute a bf16 copy in float32, which would
    flush the denormal patterns small ids make."""
    u = _UINT[x.dtype.itemsize]

    def words(a):
        b = jax.lax.bitcast_convert_type(a, u)  # [..., n] or [..., n, 4 / itemsize] when x is narrower
        return b.reshape(*a.shape[:-1], -1)
    return jnp.concatenate([words(x), words(ids), words(wts.astype(jnp.float32))], axis=-1)


def _unpack(buf, dtype, H: int, k: int):
    """The inverse of ``_pack``: (rows [..., H] of ``dtype``, ids int32 [..., k], weights float32 [..., k])."""
    per = 4 // buf.dtype.itemsize  # words per 32-bit value

    def values(b, dt):
        b = b.reshape(*b.shape[:-1], k, per) if per > 1 else b
        return jax.lax.bitcast_convert_type(b, dt)
    x = jax.lax.bitcast_convert_type(buf[..., :H], dtype)
    return x, values(buf[..., H:H + k * per], jnp.int32), values(buf[..., H + k * per:], jnp.float32)


def a2a(x, topk_idx, topk_weight, valid, slots, replicas, w, axis: str, n_ranks: int, shared=None):
    T, H = x.shape
    k = topk_idx.shape[1]
    E_loc = w.num_experts
    rank, loc = _route(topk_idx, valid, slots, replicas, E_loc, jax.lax.axis_index(axis))
    to = jnp.arange(n_ranks)[:, None, None] == rank[None]  # [R, T, k]
    send = to.any(-1)  # token t goes to rank r
    buf = jnp.where(send[..., None], x[None], jnp.zeros((), x.dtype))  # [R, T, H]
    ids = jnp.where(to, loc[None], -1).astype(jnp.int32)  # [R, T, k]
    wts = jnp.where(to, topk_weight[None], 0.0)
    exchange = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
    # One dispatch collective, not three: rows, ids and weights packed (each launch costs latency).
    rx, rids, rw = _unpack(exchange(_pack(buf, ids, wts)), x.dtype, H, k)  # row block j came from rank j
    y, ys, n = _apply_local_experts(rx.reshape(n_ranks * T, H), rids.reshape(n_ranks * T, -1),
                                    rw.reshape(n_ranks * T, -1), w, shared, x)
    back = exchange(y.astype(x.dtype).reshape(n_ranks, T, H))  # block j: rank j's partial sums
    return _plus(back.astype(jnp.float32).sum(0), ys), n


def replicated(x, topk_idx, topk_weight, valid, slots, replicas, w, axis: str, n_ranks: int, shared=None):
    E_loc = w.num_experts
    T = x.shape[0]
    me = jax.lax.axis_index(axis)
    gather = lambda a: jax.lax.all_gather(a, axis, tiled=True)
    gx, gi, gw, gv = gather(x), gather(topk_idx), gather(topk_weight), gather(valid)
    rank, loc = _route(gi, gv, slots, replicas, E_loc, jnp.arange(n_ranks * T) // T)  # source rank of each row
    y, ys, n = _apply_local_experts(gx, jnp.where(rank == me, loc, -1), gw, w, shared, x)
    return _plus(jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True), ys), n


def ragged(x, topk_idx, topk_weight, valid, slots, replicas, w, axis: str, n_ranks: int, shared=None):
    """As ``a2a`` but moving only the rows that exist (GPU only; run on one GPU, not yet on several)."""
    if jax.default_backend() == "cpu":
        raise NotImplementedError("moe_backend 'ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU does not "
                                  "implement; use 'a2a' or 'replicated' on CPU")
    T, H = x.shape
    k = topk_idx.shape[1]
    E_loc = w.num_experts
    R = n_ranks
    rank, loc = _route(topk_idx, valid, slots, replicas, E_loc, jax.lax.axis_index(axis))
    to = jnp.arange(R)[:, None, None] == rank[None]  # [R, T, k]
    send = to.any(-1)  # [R, T]
    # Pack (rank, token) pairs that exist, grouped by destination rank.
    key = jnp.where(send, jnp.arange(R)[:, None], R).reshape(-1)
    order = jnp.argsort(key, stable=True)
    send_sizes = send.sum(1).astype(jnp.int32)  # [R]
    in_off = jnp.cumsum(send_sizes) - send_sizes
    tok = order % T
    ids = jnp.where(to, loc[None], -1).reshape(R * T, k)[order]
    wts = jnp.where(to, topk_weight[None], 0.0).reshape(R * T, k)[order]
    sizes = jax.lax.all_gather(send_sizes, axis)  # [R senders, R receivers]
    me = jax.lax.axis_index(axis)
    recv_sizes = sizes[:, me]
    out_off = (jnp.cumsum(sizes, axis=0) - sizes)[me]  # where my rows land in each receiver
    cap = R * T

    def go(a, out):
        return jax.lax.ragged_all_to_all(a, out, in_off, send_sizes, out_off, recv_sizes, axis_name=axis)

    # One dispatch collective: rows, ids and weights packed as in a2a.
    empty = _pack(jnp.zeros((cap, H), x.dtype), jnp.full((cap, k), -1, jnp.int32), jnp.zeros((cap, k), jnp.float32))
    rx, rids, rw = _unpack(go(_pack(x[tok], ids, wts), empty), x.dtype, H, k)
    valid_rows = jnp.arange(cap) < recv_sizes.sum()
    y, ys, n = _apply_local_experts(rx, jnp.where(valid_rows[:, None], rids, -1), rw, w, shared, x)
    # Return path: what I received from sender s goes back to s's packed rows.
    recv_off = jnp.cumsum(recv_sizes) - recv_sizes
    back_out_off = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]  # offset of my chunk inside sender s's packed rows
    back = jax.lax.ragged_all_to_all(y.astype(x.dtype), jnp.zeros((cap, H), x.dtype), recv_off, recv_sizes,
                                     back_out_off, send_sizes, axis_name=axis)
    ok = jnp.arange(cap) < send_sizes.sum()
    y = jnp.zeros((T, H), jnp.float32).at[tok].add(jnp.where(ok[:, None], back.astype(jnp.float32), 0.0))
    return _plus(y, ys), n


def ffi(x, topk_idx, topk_weight, valid, slots, replicas, w, axis: str, n_ranks: int, shared=None):
    """As ``a2a``, with dispatch and combine as the FFI extension's custom calls (moejax/parallel/ffi_ops.py)."""
    E_loc = w.num_experts
    me = jax.lax.axis_index(axis)
    s = jnp.where(valid[:, None], physical_slots(topk_idx, slots, replicas, me), -1)  # padding goes nowhere
    r = ffi_ops.dispatch(x, s, topk_weight, me, n_ranks=n_ranks, experts_per_rank=E_loc)
    y, ys, _ = _apply_local_experts(r.x, r.ids, r.weights, w, shared, x)
    back = ffi_ops.combine(y.astype(x.dtype), r.src, me, n_ranks=n_ranks)
    return _plus(back, ys), r.expert_counts.sum()


def dispatch_fn(backend: str):
    return {"a2a": a2a, "replicated": replicated, "ragged": ragged, "ffi": ffi}[backend]
