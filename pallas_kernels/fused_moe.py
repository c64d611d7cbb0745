"""Fused MoE expert MLP over rows sorted by expert (Pallas, Triton backend).

Two kernels (not one):

1. ``_gate_up_kernel``, grid (row tiles, I tiles): x_tile @ W_gate[e] and
   x_tile @ W_up[e] in the same K loop (x read once for both), then
   SiLU(gate) * up in registers; writes h [M_pad, I_pad] in the compute dtype.
2. ``_down_kernel``, grid (row tiles, H tiles): h_tile @ W_down[e], f32 out.

Why two: every output column of the down projection needs the *whole*
intermediate row (all I columns). One kernel would either recompute gate/up
once per output tile (reading W_gate/W_up H/BN times: fatal when decode is
bound by reading the weights) or split the down projection's K over programs
and combine with float atomics (non-deterministic, and an extra zeroed f32
output). With two kernels each weight matrix is read once per row tile that
uses it, and the only extra traffic is h (M_pad x I in bf16: tiny next to the
weights at decode, ~1/4 of the activations' traffic at prefill).

Rows are grouped vLLM/SGLang-style (``moe_align_block_size``): each expert's
group is padded to a multiple of the row tile ``block_m``, so a tile never
spans two experts; per-tile expert ids (-1 = unused tile) and per-row source
indices are computed in JAX from ``group_sizes``. The kernel gathers its x rows
by index (no padded copy of x), tiles of empty experts do not exist, unused
tiles return at once. Sizes that are not multiples of the blocks are handled
by clamped index vectors plus zeroing (never an out-of-bounds access).
Routing weights are left to the caller (as with the XLA path): the dispatch
already multiplies and scatter-adds the rows, in float32.

Shared experts (optional ``shared_gate`` / ``shared_up`` [S*I, H], ``shared_down`` [H, S*I]: a
shared MLP of width S*I in HF's [out, in] layout, as the model holds it) are S extra experts
E..E+S-1 of width I after the routed ones: their tiles read the HF matrices at row / column
offset s*I, K contiguous (no transposed or stacked copy per step), so one launch streams every
expert weight of the layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import compiler_params, interpret_mode


def _group_of(ends, idx):
    """Index of the group (cumulative ends ``ends``) holding each of ``idx``; len(ends) past the last.
    compare_all, not searchsorted's default binary-search loop: an XLA:GPU while loop syncs with the
    host on every iteration; E x len(idx) comparisons cost next to nothing."""
    return jnp.searchsorted(ends, idx, side="right", method="compare_all").astype(jnp.int32)


def moe_align_block_size(group_sizes, num_rows: int, block_m: int):
    """Pads each expert's group of sorted rows to a multiple of ``block_m``.

    Returns (tile_expert [T] int32, -1 for unused tiles; row_src [T*block_m] int32, the
    sorted row each padded row reads (0 for padding); out_pos [num_rows] int32, the
    padded row holding each sorted row; out_valid [num_rows] bool, row lies in a group).
    T = cdiv(num_rows, block_m) + E is a static upper bound on the number of tiles.
    """
    gs = group_sizes.astype(jnp.int32)
    E = gs.shape[0]
    T = pl.cdiv(num_rows, block_m) + E
    tiles = (gs + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_end = jnp.cumsum(gs)
    row_start = row_end - gs
    eid = _group_of(tile_end, jnp.arange(T, dtype=jnp.int32))
    tile_expert = jnp.where(eid < E, eid, -1)
    r = jnp.arange(T * block_m, dtype=jnp.int32)
    e_r = jnp.minimum(eid[r // block_m], E - 1)
    local = r - tile_start[e_r] * block_m
    ok = (eid[r // block_m] < E) & (local < gs[e_r])
    row_src = jnp.where(ok, row_start[e_r] + local, 0).astype(jnp.int32)
    i = jnp.arange(num_rows, dtype=jnp.int32)
    e_i = _group_of(row_end, i)
    out_valid = e_i < E
    e_i = jnp.minimum(e_i, E - 1)
    out_pos = jnp.where(out_valid, tile_start[e_i] * block_m + i - row_start[e_i], 0).astype(jnp.int32)
    return tile_expert, row_src, out_pos, out_valid


def _index(start, size: int, dim: int, aligned: bool):
    """A tile's indices along one dim: a slice when in bounds by construction, else clamped ids."""
    if aligned:
        return pl.ds(start, size)
    return jnp.minimum(start + jnp.arange(size, dtype=jnp.int32), dim - 1)


def _weight_tile(w_ref, e, kidx, nidx, BK: int, BN: int):
    """w_ref [E, K, N]: the [BK, BN] tile of expert e (slices, or a 2-D gather when ragged)."""
    if isinstance(kidx, pl.Slice) and isinstance(nidx, pl.Slice):
        return w_ref[e, kidx, nidx]
    if isinstance(kidx, pl.Slice):
        kidx = kidx.start + jnp.arange(BK, dtype=jnp.int32)
    if isinstance(nidx, pl.Slice):
        nidx = nidx.start + jnp.arange(BN, dtype=jnp.int32)
    return w_ref[e, kidx[:, None], nidx[None, :]]


def _matrix_tile(w_ref, ridx, cidx, BR: int, BC: int):
    """w_ref [R, C] (2-D): the [BR, BC] tile at rows ridx, columns cidx (slices, or a gather when ragged)."""
    if isinstance(ridx, pl.Slice) and isinstance(cidx, pl.Slice):
        return w_ref[ridx, cidx]
    if isinstance(ridx, pl.Slice):
        ridx = ridx.start + jnp.arange(BR, dtype=jnp.int32)
    if isinstance(cidx, pl.Slice):
        cidx = cidx.start + jnp.arange(BC, dtype=jnp.int32)
    return w_ref[ridx[:, None], cidx[None, :]]


def _shift(idx, off):
    """Index (slice or vector) moved by ``off``: one shared expert's rows / columns of its HF matrix."""
    return pl.ds(idx.start + off, idx.size) if isinstance(idx, pl.Slice) else idx + off


def _dot_nk(x, w):
    """x [BM, BK] @ w[BN, BK]^T -> [BM, BN] float32 (a K-contiguous [out, in] tile, no transpose)."""
    return jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _gate_up_kernel(eid_ref, src_ref, x_ref, wg_ref, wu_ref, *refs, H, I, E, BM, BN, BK):
    *shared, o_ref = refs
    m, n = pl.program_id(0), pl.program_id(1)
    e = eid_ref[m]
    if shared:
        sg_ref, su_ref = shared

        @pl.when(e >= E)
        def _():
            off = (e - E) * I  # shared expert e - E: rows [off, off + I) of the HF [S*I, H] matrices
            _gate_up_tile(x_ref, src_ref, o_ref, m, n,
                          lambda x, kidx, nidx: (_dot_nk(x, _matrix_tile(sg_ref, _shift(nidx, off), kidx, BN, BK)),
                                                 _dot_nk(x, _matrix_tile(su_ref, _shift(nidx, off), kidx, BN, BK))),
                          H=H, I=I, BM=BM, BN=BN, BK=BK)

    def routed(x, kidx, nidx):
        wg = _weight_tile(wg_ref, e, kidx, nidx, BK, BN)
        wu = _weight_tile(wu_ref, e, kidx, nidx, BK, BN)
        f32 = jnp.float32
        return (jnp.dot(x, wg.astype(x.dtype), preferred_element_type=f32),
                jnp.dot(x, wu.astype(x.dtype), preferred_element_type=f32))

    @pl.when((e >= 0) & (e < E))
    def _():
        _gate_up_tile(x_ref, src_ref, o_ref, m, n, routed, H=H, I=I, BM=BM, BN=BN, BK=BK)


def _gate_up_tile(x_ref, src_ref, o_ref, m, n, dots, *, H, I, BM, BN, BK):
    """One [BM, BN] tile of SiLU(x W_gate) * (x W_up); ``dots(x, kidx, nidx)`` -> the K step's two products."""
    f32 = jnp.float32
    rows = src_ref[pl.ds(m * BM, BM)]
    nidx = _index(n * BN, BN, I, I % BN == 0)

    def step(k0, ragged, carry):
        g, u = carry
        if ragged:
            kv = k0 + jnp.arange(BK, dtype=jnp.int32)
            kidx = jnp.minimum(kv, H - 1)
            x = x_ref[rows[:, None], kidx[None, :]]
            x = jnp.where((kv < H)[None, :], x, jnp.zeros((), x.dtype))
        else:
            kidx = pl.ds(k0, BK)
            x = x_ref[rows, kidx]
        dg, du = dots(x, kidx, nidx)
        return g + dg, u + du

    carry = (jnp.zeros((BM, BN), f32), jnp.zeros((BM, BN), f32))
    if H // BK:  # (traced only when it runs: its slices would not fit otherwise)
        carry = jax.lax.fori_loop(0, H // BK, lambda k, c: step(k * BK, False, c), carry)
    if H % BK:
        carry = step((H // BK) * BK, True, carry)
    g, u = carry
    if I % BN:  # columns past I: zero, so the down kernel may run over them
        cols = n * BN + jnp.arange(BN, dtype=jnp.int32)
        u = jnp.where((cols < I)[None, :], u, 0.0)
    o_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(o_ref.dtype)


def _down_kernel(eid_ref, h_ref, wd_ref, *refs, I, I_pad, H, E, BM, BN, BK):
    *shared, o_ref = refs
    m, n = pl.program_id(0), pl.program_id(1)
    e = eid_ref[m]
    if shared:
        (sd_ref,) = shared

        @pl.when(e >= E)
        def _():
            off = (e - E) * I  # shared expert e - E: columns [off, off + I) of the HF [H, S*I] matrix
            dot = lambda h, kidx, nidx: _dot_nk(h, _matrix_tile(sd_ref, nidx, _shift(kidx, off), BN, BK))
            _down_tile(h_ref, o_ref, m, n, dot, I=I, I_pad=I_pad, H=H, BM=BM, BN=BN, BK=BK)

    def routed(h, kidx, nidx):
        w = _weight_tile(wd_ref, e, kidx, nidx, BK, BN)
        return jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)

    @pl.when((e >= 0) & (e < E))
    def _():
        _down_tile(h_ref, o_ref, m, n, routed, I=I, I_pad=I_pad, H=H, BM=BM, BN=BN, BK=BK)


def _down_tile(h_ref, o_ref, m, n, dot, *, I, I_pad, H, BM, BN, BK):
    """One [BM, BN] tile of h W_down; ``dot(h, kidx, nidx)`` -> the K step's product."""
    f32 = jnp.float32
    nidx = _index(n * BN, BN, H, H % BN == 0)

    def step(k0, ragged, acc):
        h = h_ref[pl.ds(m * BM, BM), pl.ds(k0, BK)]  # h is [M_pad, I_pad]: always in bounds
        kidx = _index(k0, BK, I, not ragged)  # rows of W_down past I: clamped (h is 0 there)
        return acc + dot(h, kidx, nidx)

    acc = jnp.zeros((BM, BN), f32)
    if I // BK:
        acc = jax.lax.fori_loop(0, I // BK, lambda k, a: step(k * BK, False, a), acc)
    for k in range(I // BK, I_pad // BK):  # at most a few ragged chunks
        acc = step(k * BK, True, acc)
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "block_n_down", "block_k_down",
                                             "num_warps", "num_stages", "interpret"))
def fused_moe(x_sorted, group_sizes, w_gate, w_up, w_down, shared_gate=None, shared_up=None, shared_down=None, *,
              block_m: int = 16, block_n: int = 64, block_k: int = 64, block_n_down: int = 64,
              block_k_down: int = 64, num_warps: int = 4, num_stages: int = 3, interpret: bool | None = None):
    """x_sorted [N, H] rows grouped by expert, group_sizes [E + S] (sum <= N); w_gate/w_up [E, H, I],
    w_down [E, I, H] -> [N, H] float32: down(silu(x @ gate) * (x @ up)) of each row's expert.
    Optional shared experts (all three or none): shared_gate / shared_up [S*I, H], shared_down
    [H, S*I] (HF's [out, in]); groups E..E+S-1 are shared expert 0..S-1 (columns s*I..(s+1)*I).
    Rows past sum(group_sizes) come back as zeros. Dots in x's dtype, float32 accumulation."""
    if interpret is None:
        interpret = interpret_mode()
    N, H = x_sorted.shape
    E, _, I = w_gate.shape
    shared = (shared_gate, shared_up, shared_down)
    if any(a is None for a in shared) != all(a is None for a in shared):
        raise ValueError("shared_gate, shared_up and shared_down go together (all or none)")
    S = 0 if shared_gate is None else shared_gate.shape[0] // I
    if S:
        for name, a, want in (("shared_gate", shared_gate, (S * I, H)), ("shared_up", shared_up, (S * I, H)),
                              ("shared_down", shared_down, (H, S * I))):
            if tuple(a.shape) != want:
                raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {want} (S shared experts of width I={I})")
    if group_sizes.shape != (E + S,):
        raise ValueError(f"group_sizes has shape {group_sizes.shape}, expected ({E + S},): {E} routed + {S} shared")
    BM, BN, BK = block_m, block_n, block_k
    BN2 = block_n_down
    BK2 = min(block_k_down, BN)  # divides I_pad (both powers of two, BK2 <= BN)
    tile_expert, row_src, out_pos, out_valid = moe_align_block_size(group_sizes, N, BM)
    T = tile_expert.shape[0]
    I_pad = pl.cdiv(I, BN) * BN
    H_pad = pl.cdiv(H, BN2) * BN2
    cp = compiler_params(num_warps, num_stages)
    whole = pl.no_block_spec
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, H=H, I=I, E=E, BM=BM, BN=BN, BK=BK),
        grid=(T, I_pad // BN),
        in_specs=[whole] * (5 + 2 * bool(S)),
        out_specs=pl.BlockSpec((BM, BN), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((T * BM, I_pad), x_sorted.dtype),
        compiler_params=cp, interpret=interpret, name="moe_gate_up",
    )(tile_expert, row_src, x_sorted, w_gate, w_up, *((shared_gate, shared_up) if S else ()))
    y = pl.pallas_call(
        functools.partial(_down_kernel, I=I, I_pad=I_pad, H=H, E=E, BM=BM, BN=BN2, BK=BK2),
        grid=(T, H_pad // BN2),
        in_specs=[whole] * (3 + bool(S)),
        out_specs=pl.BlockSpec((BM, BN2), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((T * BM, H_pad), jnp.float32),
        compiler_params=cp, interpret=interpret, name="moe_down",
    )(tile_expert, h, w_down, *((shared_down,) if S else ()))
    out = y[out_pos, :H]
    return jnp.where(out_valid[:, None], out, 0.0)
