"""Fused MoE expert MLP with block-FP8 weights (Pallas, Triton backend).

The structure of ``fused_moe.py`` (whose row grouping ``moe_align_block_size`` and tile helpers are
imported, not copied): kernel 1 computes SiLU(x @ W_gate[e]) * (x @ W_up[e]) for a tile of rows of
one expert, kernel 2 h @ W_down[e]; f32 out, rows past sum(group_sizes) zero.

Weights (``weight_layout="kn"``: [E, in, out], 128 x 128 blocks; the model passes "nk", HF's
[E, out, in] with every shape below transposed per expert, which reads 1.5x faster on the H200 at
decode sizes: K contiguous, as FP8 tensor-core operands want, benchmarks/2026-12-03f):
    w_gate, w_up [E, H, I]   s_gate, s_up [E, cdiv(H, 128), cdiv(I, 128)] float32
    w_down       [E, I, H]   s_down       [E, cdiv(I, 128), cdiv(H, 128)] float32
real weight = fp8 * scale of its block (HF's ``weight_scale_inv``, transposed per expert to the
[in, out] layout). Weights are float8_e4m3fn, or uint8 codes (``weight_format``, see fp8_utils.py).

Two variants (``variant``):

* ``"w8a16"``: each FP8 weight tile is converted in the kernel to the activation dtype (bf16), a bf16
  x bf16 dot accumulates in f32, and the block scale multiplies that K step's partial product
  (exact: the scale is constant over the step, which lies in one 128-block of K because block_k
  divides 128; a column tile reads one scale, or one per 128 columns when block_n is a multiple of
  128). Pallas-Triton dots need both operands of one dtype, hence the in-kernel conversion.
  ``weight_format="e4m3fnuz_bits"`` (MI300X) / ``"e4m3fn_bits"`` decode the bytes with integer
  arithmetic instead of an FP8 cast.
* ``"w8a8"`` (the DeepSeek / SGLang / vLLM Triton fused-MoE scheme): x is quantised per token per
  128 channels (``act_quant``, JAX, outside the kernel); e4m3fn x e4m3fn dots accumulate in f32 and
  each K step's partial product is multiplied by the token scales [BM, 1] and the weight block scale
  [1, BN]. h is re-quantised per token per 128 channels before the down projection: in kernel 1's
  epilogue when its column tile is exactly 128 wide (one group per tile: amax over the tile's
  row), else by ``act_quant`` on an f32 h between the kernels.

Sizes that are not multiples of the blocks (odd H / I, tiles cut by the matrix edge, empty experts)
are handled as in fused_moe.py: clamped index vectors plus zeroing, never an out-of-bounds access;
scale indices are clamped the same way.

What was run: the Pallas interpreter on CPU against float64 NumPy references
(tests/test_fp8_kernels.py) and lowering to Triton IR for ``cuda`` and ``rocm`` at DeepSeek-V3
shapes. Not run: no GPU here, so no PTX / HSACO was built and nothing was timed; no AMD GPU and no
MI300X run (the fnuz route is checked numerically in the interpreter and by its ROCm lowering only).
FP8 e4m3fn casts and fp8 dots need compute capability 8.9+ on NVIDIA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import compiler_params, interpret_mode
from pallas_kernels.fp8_utils import (FP8, INV_FP8_MAX, ACT_EPS, SCALE_BLOCK, act_quant, check_blocks, check_variant,
                                      load_weight, storage, zero_where_not)
from pallas_kernels.fused_moe import _index, _weight_tile, moe_align_block_size

SB = SCALE_BLOCK


def _scale_cols(s_ref, e, kb, n0: int | jax.Array, BN: int, n_blocks: int, nk: bool = False):
    """The weight scales of K block ``kb`` for the column tile starting at ``n0``, shaped to multiply a
    [BM, BN] product: a scalar when the tile lies in one 128-block, else one per column. ``nk``: the
    scales are [E, out blocks, in blocks] (HF's layout) rather than [E, in blocks, out blocks]."""
    if BN <= SB:
        return s_ref[e, n0 // SB, kb] if nk else s_ref[e, kb, n0 // SB]
    cols = jnp.minimum((n0 + jnp.arange(BN, dtype=jnp.int32)) // SB, n_blocks - 1)
    return (s_ref[e, cols, kb] if nk else s_ref[e, kb, cols])[None, :]


def _tile_dot(x, w_ref, e, kidx, nidx, BK: int, BN: int, fmt: str, cdt, nk: bool):
    """x [BM, BK] @ the weight tile (converted to ``cdt``) -> [BM, BN] float32. ``nk``: the weights are
    [E, N, K] (K contiguous, HF's [out, in]), read as a [BN, BK] tile and contracted on its last dim:
    the operand layout FP8 tensor-core dots take without a transpose in shared memory."""
    if nk:
        w = load_weight(_weight_tile(w_ref, e, nidx, kidx, BN, BK), fmt, cdt)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    w = load_weight(_weight_tile(w_ref, e, kidx, nidx, BK, BN), fmt, cdt)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _gate_up_kernel(*refs, H, I, BM, BN, BK, a8, fmt, fuse_quant, nk, cdt16):
    if a8:
        eid_ref, src_ref, x_ref, xs_ref, wg_ref, sg_ref, wu_ref, su_ref, *outs = refs
    else:
        eid_ref, src_ref, x_ref, wg_ref, sg_ref, wu_ref, su_ref, *outs = refs
    m, n = pl.program_id(0), pl.program_id(1)
    e = eid_ref[m]
    nNb = pl.cdiv(I, SB)  # scale columns; K blocks need no clamp (k0 < H)

    @pl.when(e >= 0)
    def _():
        f32 = jnp.float32
        rows = src_ref[pl.ds(m * BM, BM)]
        nidx = _index(n * BN, BN, I, I % BN == 0)

        def step(k0, ragged, carry):
            g, u = carry
            if ragged:
                kv = k0 + jnp.arange(BK, dtype=jnp.int32)
                kidx = jnp.minimum(kv, H - 1)
                x = zero_where_not((kv < H)[None, :], x_ref[rows[:, None], kidx[None, :]])
            else:
                kidx = pl.ds(k0, BK)
                x = x_ref[rows, kidx]
            kb = k0 // SB  # the step's K block (BK divides 128)
            if cdt16:
                x = x.astype(jnp.float16)
            cdt = FP8 if a8 else x.dtype
            sg = _scale_cols(sg_ref, e, kb, n * BN, BN, nNb, nk)
            su = _scale_cols(su_ref, e, kb, n * BN, BN, nNb, nk)
            dg = _tile_dot(x, wg_ref, e, kidx, nidx, BK, BN, fmt, cdt, nk)
            du = _tile_dot(x, wu_ref, e, kidx, nidx, BK, BN, fmt, cdt, nk)
            if a8:
                xs = xs_ref[rows, kb][:, None]  # [BM, 1] token scales of this K block
                sg, su = xs * sg, xs * su
            return g + dg * sg, u + du * su

        carry = (jnp.zeros((BM, BN), f32), jnp.zeros((BM, BN), f32))
        if H // BK:
            carry = jax.lax.fori_loop(0, H // BK, lambda k, c: step(k * BK, False, c), carry)
        if H % BK:
            carry = step((H // BK) * BK, True, carry)
        g, u = carry
        if I % BN:  # columns past I: zero, so the down kernel may run over them
            cols = n * BN + jnp.arange(BN, dtype=jnp.int32)
            u = jnp.where((cols < I)[None, :], u, 0.0)
        h = g * jax.nn.sigmoid(g) * u
        if fuse_quant:  # one 128-channel group per tile: requantise here (act_quant's formula)
            o_ref, os_ref = outs
            hs = jnp.maximum(jnp.max(jnp.abs(h), axis=1), ACT_EPS) * INV_FP8_MAX
            o_ref[...] = (h / hs[:, None]).astype(o_ref.dtype)
            os_ref[...] = hs
        else:
            outs[0][...] = h.astype(outs[0].dtype)


def _down_kernel(*refs, I, I_pad, H, BM, BN, BK, a8, fmt, nk, cdt16):
    if a8:
        eid_ref, h_ref, hs_ref, wd_ref, sd_ref, o_ref = refs
    else:
        eid_ref, h_ref, wd_ref, sd_ref, o_ref = refs
    m, n = pl.program_id(0), pl.program_id(1)
    e = eid_ref[m]
    nKb, nNb = pl.cdiv(I, SB), pl.cdiv(H, SB)

    @pl.when(e >= 0)
    def _():
        f32 = jnp.float32
        nidx = _index(n * BN, BN, H, H % BN == 0)

        def step(k0, ragged, acc):
            h = h_ref[pl.ds(m * BM, BM), pl.ds(k0, BK)]  # [M_pad, I_pad]: always in bounds
            kidx = _index(k0, BK, I, not ragged)  # rows of W_down past I: clamped (h is 0 there)
            if cdt16:
                h = h.astype(jnp.float16)
            s = _scale_cols(sd_ref, e, jnp.minimum(k0 // SB, nKb - 1), n * BN, BN, nNb, nk)
            if a8:
                s = hs_ref[pl.ds(m * BM, BM), k0 // SB][:, None] * s
            return acc + _tile_dot(h, wd_ref, e, kidx, nidx, BK, BN, fmt, h.dtype, nk) * s

        acc = jnp.zeros((BM, BN), f32)
        if I // BK:
            acc = jax.lax.fori_loop(0, I // BK, lambda k, a: step(k * BK, False, a), acc)
        for k in range(I // BK, I_pad // BK):  # at most a few ragged chunks
            acc = step(k * BK, True, acc)
        o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("variant", "weight_format", "block_m", "block_n", "block_k",
                                             "block_n_down", "block_k_down", "num_warps", "num_stages",
                                             "weight_layout", "compute_dtype", "interpret"))
def fused_moe_fp8(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, *, variant: str = "w8a16",
                  weight_format: str | None = None, block_m: int = 16, block_n: int = 64, block_k: int = 64,
                  block_n_down: int = 64, block_k_down: int = 64, num_warps: int = 4, num_stages: int = 3,
                  weight_layout: str = "kn", compute_dtype: str | None = None, interpret: bool | None = None):
    """x_sorted [N, H] (bf16) rows grouped by expert, group_sizes [E] (sum <= N);
    w_gate / w_up [E, H, I] and w_down [E, I, H] FP8 (float8_e4m3fn, float8_e4m3fnuz, or uint8 codes
    with ``weight_format``), scales s_gate / s_up [E, cdiv(H,128), cdiv(I,128)] and s_down
    [E, cdiv(I,128), cdiv(H,128)] float32 (real = fp8 * scale) -> [N, H] float32:
    down(silu(x @ gate) * (x @ up)) of each row's expert, rows past sum(group_sizes) zero.

    ``variant``: "w8a16" (weights converted to x's dtype in the kernel) or "w8a8" (activations
    quantised per token per 128 channels, fp8 x fp8 dots). block_k and block_k_down must divide 128;
    block_n and block_n_down must divide 128 or be multiples of it.

    ``weight_layout="nk"``: every weight and scale is given as [E, out, in] (HF's per-expert layout,
    K contiguous: w_gate / w_up [E, I, H], w_down [E, H, I], scales likewise) instead of [E, in, out].
    ``compute_dtype="float16"`` (w8a16 only): activations and weights meet in an f16 dot (FP8 -> f16
    is one conversion; FP8 -> bf16 goes through f16 or f32); activations must stay inside f16's range."""
    if weight_layout not in ("kn", "nk"):
        raise ValueError(f"weight_layout must be 'kn' or 'nk', got {weight_layout!r}")
    if compute_dtype not in (None, "float16") or (compute_dtype and variant != "w8a16"):
        raise ValueError(f"compute_dtype must be None or 'float16' (w8a16 only), got {compute_dtype!r}")
    nk, cdt16 = weight_layout == "nk", compute_dtype == "float16"
    if interpret is None:
        interpret = interpret_mode()
    w_gate, fmt = storage(w_gate, weight_format)
    w_up, _ = storage(w_up, fmt)
    w_down, _ = storage(w_down, fmt)
    check_variant(variant, fmt)
    a8 = variant == "w8a8"
    N, H = x_sorted.shape
    E, I = w_gate.shape[0], w_gate.shape[1 if nk else 2]
    BM, BN, BK = block_m, block_n, block_k
    BN2 = block_n_down
    BK2 = min(block_k_down, BN, SB)  # divides I_pad (powers of two, BK2 <= BN) and 128
    check_blocks(BN, BK, "gate/up ")
    check_blocks(BN2, BK2, "down ")
    _check_weight_shapes(E, H, I, nk, w_gate=w_gate, w_up=w_up, w_down=w_down, s_gate=s_gate, s_up=s_up,
                         s_down=s_down)
    s_gate, s_up, s_down = (s.astype(jnp.float32) for s in (s_gate, s_up, s_down))
    tile_expert, row_src, out_pos, out_valid = moe_align_block_size(group_sizes, N, BM)
    I_pad = pl.cdiv(I, BN) * BN
    cp = compiler_params(num_warps, num_stages)
    fuse_quant = a8 and BN == SB
    h = _gate_up(x_sorted, tile_expert, row_src, w_gate, s_gate, w_up, s_up, H=H, I=I, I_pad=I_pad, BM=BM, BN=BN,
                 BK=BK, a8=a8, fmt=fmt, fuse_quant=fuse_quant, nk=nk, cdt16=cdt16, cp=cp, interpret=interpret)
    if a8:
        h = h if fuse_quant else act_quant(h)  # (codes, scales) per token per 128 channels
    y = _down(tile_expert, h, w_down, s_down, H=H, I=I, I_pad=I_pad, BM=BM, BN=BN2, BK=BK2, a8=a8, fmt=fmt, nk=nk,
              cdt16=cdt16, cp=cp, interpret=interpret)
    out = y[out_pos, :H]
    return jnp.where(out_valid[:, None], out, 0.0)


def _check_weight_shapes(E: int, H: int, I: int, nk: bool, **arrays) -> None:
    """A ValueError naming the first weight or scale whose shape is not the one ``fused_moe_fp8`` takes."""
    def io(a, b):  # a shape given as (in, out), in the weights' layout
        return (b, a) if nk else (a, b)

    lay = "[E, out, in]" if nk else "[E, in, out]"
    for name, shape in (("w_gate", io(H, I)), ("w_up", io(H, I)), ("w_down", io(I, H))):
        if tuple(arrays[name].shape) != (E, *shape):
            raise ValueError(f"{name} has shape {tuple(arrays[name].shape)}, expected {(E, *shape)} ({lay})")
    for name, shape in (("s_gate", io(pl.cdiv(H, SB), pl.cdiv(I, SB))), ("s_up", io(pl.cdiv(H, SB), pl.cdiv(I, SB))),
                        ("s_down", io(pl.cdiv(I, SB), pl.cdiv(H, SB)))):
        if tuple(arrays[name].shape) != (E, *shape):
            raise ValueError(f"{name} has shape {tuple(arrays[name].shape)}, expected {(E, *shape)} "
                             f"(128 x 128 blocks, {lay})")


def _gate_up(x_sorted, tile_expert, row_src, w_gate, s_gate, w_up, s_up, *, H, I, I_pad, BM, BN, BK, a8, fmt,
             fuse_quant, nk, cdt16, cp, interpret):
    """Kernel 1: h = SiLU(x @ W_gate[e]) * (x @ W_up[e]) per row tile [T * BM, I_pad]: x's dtype (w8a16), f32
    (w8a8), or (FP8 codes, per-128-channel scales) when its epilogue quantises (``fuse_quant``)."""
    T = tile_expert.shape[0]
    if a8:
        xq, xs = act_quant(x_sorted)
        args = (tile_expert, row_src, xq, xs, w_gate, s_gate, w_up, s_up)
    else:
        args = (tile_expert, row_src, x_sorted, w_gate, s_gate, w_up, s_up)
    if fuse_quant:
        out_specs = [pl.BlockSpec((BM, BN), lambda m, n: (m, n)), pl.BlockSpec((BM, None), lambda m, n: (m, n))]
        out_shape = [jax.ShapeDtypeStruct((T * BM, I_pad), FP8),
                     jax.ShapeDtypeStruct((T * BM, I_pad // SB), jnp.float32)]
    else:
        out_specs = pl.BlockSpec((BM, BN), lambda m, n: (m, n))
        out_shape = jax.ShapeDtypeStruct((T * BM, I_pad), jnp.float32 if a8 else x_sorted.dtype)
    return pl.pallas_call(
        functools.partial(_gate_up_kernel, H=H, I=I, BM=BM, BN=BN, BK=BK, a8=a8, fmt=fmt, fuse_quant=fuse_quant,
                          nk=nk, cdt16=cdt16),
        grid=(T, I_pad // BN),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=cp, interpret=interpret, name="moe_fp8_gate_up",
    )(*args)


def _down(tile_expert, h, w_down, s_down, *, H, I, I_pad, BM, BN, BK, a8, fmt, nk, cdt16, cp, interpret):
    """Kernel 2: h @ W_down[e] per row tile -> [T * BM, H_pad] float32 (``h``: (codes, scales) for w8a8)."""
    T = tile_expert.shape[0]
    H_pad = pl.cdiv(H, BN) * BN
    args = (tile_expert, *h, w_down, s_down) if a8 else (tile_expert, h, w_down, s_down)
    return pl.pallas_call(
        functools.partial(_down_kernel, I=I, I_pad=I_pad, H=H, BM=BM, BN=BN, BK=BK, a8=a8, fmt=fmt, nk=nk,
                          cdt16=cdt16),
        grid=(T, H_pad // BN),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.BlockSpec((BM, BN), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((T * BM, H_pad), jnp.float32),
        compiler_params=cp, interpret=interpret, name="moe_fp8_down",
    )(*args)
