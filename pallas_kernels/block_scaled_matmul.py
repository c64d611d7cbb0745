"""Block-scaled FP8 dense GEMM for the projections (Pallas, Triton backend).

    y[M, N] = x[M, K] @ (W[N, K] * scale)^T

W is an FP8 weight in HF's layout [out, in] (as moejax's ``Linear`` keeps it: y = x @ W.T) and
``scale`` [cdiv(N, 128), cdiv(K, 128)] float32 its per-block ``weight_scale_inv`` (real = fp8 *
scale). Grid (row tiles, column tiles[, K splits]); each program walks its K range in steps of
``block_k`` (a divisor of 128, so a step lies in one scale block) and multiplies the step's partial
product by the block's scale (one scalar when ``block_n`` <= 128, one per 128 columns otherwise):

* ``"w8a16"``: the W tile is converted to x's dtype in the kernel (an FP8 cast, or the integer decode
  of ``weight_format="e4m3fn_bits" | "e4m3fnuz_bits"``, see fp8_utils.py), bf16 dot, f32 accumulation.
* ``"w8a8"``: x is quantised per token per 128 channels (``act_quant``, outside the kernel), fp8 x
  fp8 dot, f32 accumulation, token scale x weight scale per step.

Decode-sized M gives few column tiles for narrow projections (kv_a: 576 columns), so ``num_splits``
splits K over a third grid axis: each split writes an f32 partial [M, N] and XLA sums them
(deterministic; no atomics). Ragged M / N / K are handled with clamped indices and zeroing; the
output is allocated padded to whole tiles and sliced.

What was run: the Pallas interpreter on CPU against a float64 NumPy reference and the XLA
dequantise-then-dot path, and lowering to Triton IR for ``cuda`` and ``rocm``. Not run: no GPU
here (no PTX / HSACO built, nothing timed); no AMD GPU / MI300X. FP8 e4m3fn casts and fp8 dots need
compute capability 8.9+ on NVIDIA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import compiler_params, interpret_mode
from pallas_kernels.fp8_utils import (FP8, SCALE_BLOCK, act_quant, check_blocks, check_variant, load_weight,
                                      storage, zero_where_not)
from pallas_kernels.fused_moe import _index

SB = SCALE_BLOCK
_NT = (((1,), (1,)), ((), ()))  # x [BM, BK] . w [BN, BK] -> [BM, BN]


def _tile_2d(ref, ridx, cidx, R: int, C: int):
    """ref [*, *]: the [R, C] tile at row indices ``ridx`` and column indices ``cidx`` (slices, or
    clamped index vectors)."""
    if isinstance(ridx, pl.Slice) and isinstance(cidx, pl.Slice):
        return ref[ridx, cidx]
    if isinstance(ridx, pl.Slice):
        ridx = ridx.start + jnp.arange(R, dtype=jnp.int32)
    if isinstance(cidx, pl.Slice):
        cidx = cidx.start + jnp.arange(C, dtype=jnp.int32)
    return ref[ridx[:, None], cidx[None, :]]


def _bsmm_kernel(*refs, M, N, K, BM, BN, BK, KS, splits, a8, fmt):
    if a8:
        x_ref, xs_ref, w_ref, s_ref, o_ref = refs
    else:
        x_ref, w_ref, s_ref, o_ref = refs
    m, n = pl.program_id(0), pl.program_id(1)
    sp = pl.program_id(2) if splits > 1 else 0
    f32 = jnp.float32
    nNb = pl.cdiv(N, SB)
    ridx = _index(m * BM, BM, M, M % BM == 0)
    nidx = _index(n * BN, BN, N, N % BN == 0)
    k_lo = sp * KS
    k_len = jnp.minimum(KS, K - k_lo) if splits > 1 else K  # this split's K range [k_lo, k_lo + k_len)

    def step(k0, ragged, acc):
        if ragged:
            kv = k0 + jnp.arange(BK, dtype=jnp.int32)
            x = zero_where_not((kv < K)[None, :], _tile_2d(x_ref, ridx, jnp.minimum(kv, K - 1), BM, BK))
            kidx = jnp.minimum(kv, K - 1)
        else:
            kidx = pl.ds(k0, BK)
            x = _tile_2d(x_ref, ridx, kidx, BM, BK)
        kb = k0 // SB
        w = load_weight(_tile_2d(w_ref, nidx, kidx, BN, BK), fmt, FP8 if a8 else x.dtype)
        if BN <= SB:
            s = s_ref[(n * BN) // SB, kb]
        else:
            s = s_ref[jnp.minimum((n * BN + jnp.arange(BN, dtype=jnp.int32)) // SB, nNb - 1), kb][None, :]
        if a8:
            s = xs_ref[ridx, kb][:, None] * s  # [BM, 1] token scales of this K block
        return acc + jax.lax.dot_general(x, w, _NT, preferred_element_type=f32) * s

    acc = jnp.zeros((BM, BN), f32)
    n_full = k_len // BK
    if splits > 1 or K >= BK:  # K < BK: no whole step, and tracing one would slice past K
        acc = jax.lax.fori_loop(0, n_full, lambda i, a: step(k_lo + i * BK, False, a), acc)
    if K % BK:  # the ragged step at the end of K (in the last split only)
        last = (K // BK) * BK
        if splits > 1:
            acc = jax.lax.fori_loop(0, (sp == splits - 1).astype(jnp.int32), lambda i, a: step(last, True, a), acc)
        else:
            acc = step(last, True, acc)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("variant", "weight_format", "out_dtype", "block_m", "block_n",
                                             "block_k", "num_splits", "num_warps", "num_stages", "interpret"))
def block_scaled_matmul(x, w, scale, *, variant: str = "w8a16", weight_format: str | None = None, out_dtype=None,
                        block_m: int = 16, block_n: int = 128, block_k: int = 128, num_splits: int = 1,
                        num_warps: int = 4, num_stages: int = 3, interpret: bool | None = None):
    """x [M, K] (bf16), w [N, K] FP8 (float8_e4m3fn, float8_e4m3fnuz, or uint8 codes with
    ``weight_format``), scale [cdiv(N,128), cdiv(K,128)] float32 -> [M, N] in ``out_dtype``
    (default x's dtype; float32 accepted): x @ (w * scale)^T with float32 accumulation.

    block_k must divide 128; block_n must divide 128 or be a multiple of it. ``num_splits`` > 1
    splits K (whole 128-blocks per split) over a third grid axis, partials summed in f32."""
    if interpret is None:
        interpret = interpret_mode()
    w, fmt = storage(w, weight_format)
    check_variant(variant, fmt)
    a8 = variant == "w8a8"
    M, K = x.shape
    N, K2 = w.shape
    if K2 != K:
        raise ValueError(f"x [{M}, {K}] and w [{N}, {K2}] (HF layout [out, in]) disagree on K")
    if tuple(scale.shape) != (pl.cdiv(N, SB), pl.cdiv(K, SB)):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {(pl.cdiv(N, SB), pl.cdiv(K, SB))}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    BM, BN, BK = block_m, block_n, block_k
    check_blocks(BN, BK)
    nKb = pl.cdiv(K, SB)
    blocks_per_split = pl.cdiv(nKb, max(1, min(num_splits, nKb)))
    splits = pl.cdiv(nKb, blocks_per_split)  # every split non-empty
    KS = blocks_per_split * SB
    M_pad, N_pad = pl.cdiv(M, BM) * BM, pl.cdiv(N, BN) * BN
    if a8:
        xq, xs = act_quant(x)
        args = (xq, xs, w, scale.astype(jnp.float32))
    else:
        args = (x, w, scale.astype(jnp.float32))
    kernel = functools.partial(_bsmm_kernel, M=M, N=N, K=K, BM=BM, BN=BN, BK=BK, KS=KS, splits=splits, a8=a8,
                               fmt=fmt)
    common = dict(in_specs=[pl.no_block_spec] * len(args), compiler_params=compiler_params(num_warps, num_stages),
                  interpret=interpret, name="block_scaled_matmul")
    if splits == 1:
        y = pl.pallas_call(kernel, grid=(M_pad // BM, N_pad // BN),
                           out_specs=pl.BlockSpec((BM, BN), lambda m, n: (m, n)),
                           out_shape=jax.ShapeDtypeStruct((M_pad, N_pad), out_dtype), **common)(*args)
    else:
        parts = pl.pallas_call(kernel, grid=(M_pad // BM, N_pad // BN, splits),
                               out_specs=pl.BlockSpec((None, BM, BN), lambda m, n, s: (s, m, n)),
                               out_shape=jax.ShapeDtypeStruct((splits, M_pad, N_pad), jnp.float32), **common)(*args)
        y = jnp.sum(parts, axis=0).astype(out_dtype)
    return y[:M, :N] if (M_pad, N_pad) != (M, N) else y
