"""GEMMs written in Triton (called through jax-triton): the block-FP8 W8A8 dense projection and routed-expert
MLP, the design of vLLM's / SGLang's ``w8a8_block_fp8_matmul`` and block-quantised ``fused_moe_kernel``
(DeepSeek-V3's scheme: 128 x 128 weight blocks, activations per token per 128 channels); the same expert
kernels unscaled in bf16 (``fused_moe_triton``, the model's [E, in, out] layout: selectable, measured level
with the Pallas kernel, not chosen); and the per-token-group activation quantiser (``act_quant_triton``).

Why Triton and not Pallas here: the same GEMMs through Pallas-Triton ran 2.4-4x slower on Hopper
(``jax_triton_compat`` says more); these kernels keep the loops, pointers and masks as the Triton
authors of those kernels wrote them, so Triton's Hopper pipeline (wgmma, async copies) applies as in
vLLM. Numerics as the Pallas W8A8 kernels (``fused_moe_fp8.py``, ``block_scaled_matmul.py``): each
128-deep K step is one fp8 x fp8 dot (the tensor core sums 128 products), scaled by the activation
scales [BM, 1] and the weight block scale, added into an f32 accumulator.

Layouts (HF's; K contiguous, as FP8 tensor-core operands want):
    dense:   x_q [M, K] e4m3fn, x_s [M, cdiv(K,128)] f32; w [N, K] e4m3fn, w_s [cdiv(N,128), cdiv(K,128)]
    experts: w_gate, w_up [E, I, H], scales [E, cdiv(I,128), cdiv(H,128)]; w_down [E, H, I],
             s_down [E, cdiv(H,128), cdiv(I,128)]
Experts take rows sorted by expert with ``group_sizes`` (the Pallas kernels' contract): each expert's
group is padded to the row tile (``moe_align_block_size``), padding rows point past the last row and
are masked; kernel 1 computes SiLU(x Wg^T) * (x Wu^T) and requantises h per token per 128 channels in
its epilogue (its column tile is one 128-block), kernel 2 h Wd^T straight into the row's sorted
position (rows of no expert stay zero: a zeroed output).

Exactness: against float64 NumPy on the device and in Triton's interpreter on CPU
(tests/test_triton_fp8.py). ROCm: the same Triton source runs through jax-triton's HIP backend
with float8_e4m3fnuz; not run here (no AMD GPU), and selection keeps the Pallas W8A16 route there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fp8_utils import FP8, SCALE_BLOCK, inv_fp8_max
from pallas_kernels.fused_moe import moe_align_block_size
from pallas_kernels.jax_triton_compat import helper, jit, triton_call

tl = None  # triton.language, set by jax_triton_compat.Kernel on first launch (Triton may be absent)

SB = SCALE_BLOCK


@helper
def _to_fp8_grid(q, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    # q (f32) rounded to the FP8 grid, to nearest even, before the cast, so the cast is exact: Triton's
    # interpreter (3.6) drops a binade when rounding carries into the exponent (124.1 -> 64), and the CPU
    # tests run there; the GPU's cvt gives the same result either way. Normal values keep 3 mantissa
    # bits; subnormals (below MIN_NORMAL) are multiples of its 2**-3, rounded by adding and removing
    # MAGIC (1.5 x 2**23 steps) to the magnitude.
    bits = q.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    sub = (tl.abs(q) + MAGIC) - MAGIC
    return tl.where(tl.abs(q) < MIN_NORMAL, tl.where(q < 0, -sub, sub), bits.to(tl.float32, bitcast=True))


@jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                      INV_MAX: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    # One [BM, 128] group block a program: act_quant's formula, its division rounded to nearest (div.rn,
    # as XLA's) so the codes and scales are the XLA path's bit for bit.
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    KB: tl.constexpr = (K + 127) // 128
    rows = pid_m * BM + tl.arange(0, BM)
    cols = kb * 128 + tl.arange(0, 128)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sc = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * INV_MAX
    q = _to_fp8_grid(tl.math.div_rn(x, sc[:, None]), MIN_NORMAL, MAGIC)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows * KB + kb, sc, mask=rows < M)


@functools.partial(jax.jit, static_argnames=("dtype", "block_m"))
def act_quant_triton(x, dtype=FP8, block_m: int = 32):
    """``fp8_utils.act_quant`` (per token per 128 channels) as one Triton kernel: one read of x, one
    write of the codes and scales (XLA's form took two passes, one a poorly fused reduction: ~0.1 ms on
    the 4096 x 7168 rows of a V3 EP8 rank's experts at 512 sequences, H100 profile of 2026-12-06c)."""
    M, K = x.shape
    KB = pl.cdiv(K, SB)
    return triton_call(x, kernel=_act_quant_kernel,
                       out_shape=(jax.ShapeDtypeStruct((M, K), jnp.dtype(dtype)),
                                  jax.ShapeDtypeStruct((M, KB), jnp.float32)),
                       grid=(pl.cdiv(M, block_m), KB), num_warps=4, num_stages=1, name="act_quant",
                       M=M, K=K, BM=block_m, **_fp8_grid(dtype))


@jit
def _dense_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped launch order (GROUP_M row tiles share each column tile while it is in L2), as vLLM's kernel.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    KB: tl.constexpr = (K + 127) // 128

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = offs_m % M  # out-of-range rows / columns read in range (their results are not stored)
    cols = offs_n % N
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + rows[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * K + offs_k[:, None]  # [BK, BN] view of w [N, K]
    xs_ptrs = xs_ptr + rows * KB
    ws_ptrs = ws_ptr + (cols // 128) * KB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_left = K - k * BK
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        kb = (k * BK) // 128
        a_s = tl.load(xs_ptrs + kb)
        b_s = tl.load(ws_ptrs + kb)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        x_ptrs += BK
        w_ptrs += BK
    o_ptrs = o_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "block_k", "group_m",
                                             "num_warps", "num_stages"))
def block_fp8_matmul(x, w, w_scale, *, out_dtype=jnp.bfloat16, block_m: int = 64, block_n: int = 128,
                     block_k: int = 128, group_m: int = 8, num_warps: int = 4, num_stages: int = 3):
    """x [M, K] (bf16/f32) @ (w [N, K] e4m3fn * w_scale [cdiv(N,128), cdiv(K,128)])^T -> [M, N]
    ``out_dtype``; x is quantised per token per 128 channels (``act_quant_triton``) first. block_k
    divides 128 (a K step lies in one scale block); block_n divides 128 or is a multiple of it (a column
    tile reads one weight scale a column)."""
    M, K = x.shape
    N = w.shape[0]
    _check(w, w_scale, (N, K), block_n, block_k, "w")
    xq, xs = act_quant_triton(x, dtype=w.dtype)
    grid = (pl.cdiv(M, block_m) * pl.cdiv(N, block_n),)
    return triton_call(xq, xs, w, w_scale.astype(jnp.float32), kernel=_dense_kernel,
                       out_shape=jax.ShapeDtypeStruct((M, N), jnp.dtype(out_dtype)), grid=grid,
                       num_warps=num_warps, num_stages=num_stages, name="block_fp8_matmul",
                       M=M, N=N, K=K, BM=block_m, BN=block_n, BK=block_k, GROUP_M=group_m)


@jit
def _gate_up_kernel(x_ptr, xs_ptr, src_ptr, eid_ptr, wg_ptr, sg_ptr, wu_ptr, su_ptr, h_ptr, hs_ptr,
                    N_ROWS: tl.constexpr, H: tl.constexpr, I: tl.constexpr, I_PAD: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INV_MAX: tl.constexpr,
                    MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, SWN: tl.constexpr, SWK: tl.constexpr,
                    SCALED: tl.constexpr):
    # SWN / SWK: an expert's weight strides along its output / input dim (FP8: HF's [I, H]; bf16: the
    # model's [H, I]). SCALED: block-FP8 (scales, h requantised) or plain bf16 (xs/sg/su/hs unused).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(eid_ptr + pid_m)
    if e < 0:  # an unused tile (the static tile count is an upper bound)
        return
    KB: tl.constexpr = (H + 127) // 128
    IB: tl.constexpr = (I + 127) // 128
    e64 = e.to(tl.int64)
    rows = tl.load(src_ptr + pid_m * BM + tl.arange(0, BM))
    row_ok = rows < N_ROWS  # padding rows point past the last row
    rows = tl.where(row_ok, rows, 0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    cols = offs_n % I
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + rows[:, None] * H + offs_k[None, :]
    w_off = e64 * I * H + cols[None, :] * SWN + offs_k[:, None] * SWK  # [BK, BN] view of the expert's weight
    wg_ptrs = wg_ptr + w_off
    wu_ptrs = wu_ptr + w_off
    xs_ptrs = xs_ptr + rows * KB
    s_off = e * IB * KB + (pid_n * BN // 128) * KB  # SCALED: BN == 128, one scale block a column tile
    g = tl.zeros((BM, BN), dtype=tl.float32)
    u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BK)):
        k_left = H - k * BK
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        bg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        bu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if SCALED:
            kb = (k * BK) // 128
            a_s = tl.load(xs_ptrs + kb)
            g += tl.dot(a, bg) * (a_s[:, None] * tl.load(sg_ptr + s_off + kb))
            u += tl.dot(a, bu) * (a_s[:, None] * tl.load(su_ptr + s_off + kb))
        else:
            g = tl.dot(a, bg, g)
            u = tl.dot(a, bu, u)
        x_ptrs += BK
        wg_ptrs += BK * SWK
        wu_ptrs += BK * SWK
    h = g * tl.sigmoid(g) * u
    h = tl.where((offs_n < I)[None, :], h, 0.0)  # columns past I: zero (the down kernel reads them)
    out_rows = pid_m * BM + tl.arange(0, BM)
    if SCALED:
        # Requantise per token per 128 channels (this tile is one group): act_quant's formula.
        hs = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-10) * INV_MAX
        hq = _to_fp8_grid(tl.math.div_rn(h, hs[:, None]), MIN_NORMAL, MAGIC).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + out_rows[:, None] * I_PAD + offs_n[None, :], hq)
        tl.store(hs_ptr + out_rows * (I_PAD // 128) + pid_n, hs)
    else:
        tl.store(h_ptr + out_rows[:, None] * I_PAD + offs_n[None, :], h.to(h_ptr.dtype.element_ty))


@jit
def _down_kernel(h_ptr, hs_ptr, src_ptr, eid_ptr, wd_ptr, sd_ptr, o_ptr,
                 N_ROWS: tl.constexpr, H: tl.constexpr, I: tl.constexpr, I_PAD: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SWN: tl.constexpr, SWK: tl.constexpr, SCALED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(eid_ptr + pid_m)
    if e < 0:
        return
    KB: tl.constexpr = (I + 127) // 128
    HB: tl.constexpr = (H + 127) // 128
    e64 = e.to(tl.int64)
    in_rows = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    cols = offs_n % H
    offs_k = tl.arange(0, BK)
    h_ptrs = h_ptr + in_rows[:, None] * I_PAD + offs_k[None, :]
    w_ptrs = wd_ptr + e64 * H * I + cols[None, :] * SWN + offs_k[:, None] * SWK  # [BK, BN] view
    hs_ptrs = hs_ptr + in_rows * (I_PAD // 128)
    s_ptrs = sd_ptr + e * HB * KB + (cols // 128) * KB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(I, BK)):
        k_left = I - k * BK
        a = tl.load(h_ptrs)  # h is [T*BM, I_PAD]: always in bounds, zero past I
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if SCALED:
            kb = (k * BK) // 128
            acc += tl.dot(a, b) * (tl.load(hs_ptrs + kb)[:, None] * tl.load(s_ptrs + kb)[None, :])
        else:
            acc = tl.dot(a, b, acc)
        h_ptrs += BK
        w_ptrs += BK * SWK
    rows = tl.load(src_ptr + in_rows)
    ok = (rows < N_ROWS)[:, None] & (offs_n < H)[None, :]
    rows = tl.where(rows < N_ROWS, rows, 0)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * H + offs_n[None, :], acc.to(o_ptr.dtype.element_ty), mask=ok)


def _fp8_grid(dtype) -> dict:
    """The constants the kernels round to an FP8 type's grid with: 1 / its largest value, its smallest
    normal, and the f32 constant whose addition rounds to multiples of its subnormal step (1.5 x 2**23
    steps): e4m3fn 2**-6 and 2**-9, e4m3fnuz (bias 8) 2**-7 and 2**-10."""
    bias = 8 if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fnuz) else 7
    return dict(INV_MAX=inv_fp8_max(dtype), MIN_NORMAL=2.0 ** (1 - bias), MAGIC=1.5 * 2.0 ** (23 - bias - 2))


FP8_TYPES = (jnp.dtype(FP8), jnp.dtype(jnp.float8_e4m3fnuz))  # NVIDIA (sm_89+), MI300X (gfx942)


def _check(w, s, shape, block_n: int, block_k: int, name: str):
    if jnp.dtype(w.dtype) not in FP8_TYPES:
        raise ValueError(f"{name} must be float8_e4m3fn or float8_e4m3fnuz for the Triton W8A8 kernels, "
                         f"got {w.dtype}")
    if tuple(w.shape[-2:]) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected [..., {shape[0]}, {shape[1]}] ([out, in])")
    want = (pl.cdiv(shape[0], SB), pl.cdiv(shape[1], SB))
    if tuple(s.shape[-2:]) != want:
        raise ValueError(f"{name}'s scale has shape {tuple(s.shape)}, expected [..., {want[0]}, {want[1]}] "
                         "(128 x 128 blocks)")
    if block_k > SB or SB % block_k:
        raise ValueError(f"block_k={block_k} must divide {SB}")
    if (block_n > SB and block_n % SB) or (block_n <= SB and SB % block_n):
        raise ValueError(f"block_n={block_n} must divide {SB} or be a multiple of it")


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n_down", "num_warps", "num_stages",
                                             "out_dtype"))
def fused_moe_block_fp8(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, *, block_m: int = 64,
                        block_k: int = 128, block_n_down: int = 128, num_warps: int = 4, num_stages: int = 3,
                        out_dtype=jnp.float32):
    """Routed-expert MLP with block-FP8 weights, W8A8: x_sorted [N, H] rows grouped by expert,
    group_sizes [E] (sum <= N), weights in HF's [E, out, in] layout (module docstring) -> [N, H]
    ``out_dtype``: down(silu(x @ gate^T) * (x @ up^T)) of each row's expert, rows past
    sum(group_sizes) zero. The gate/up column tile is 128 (one scale block: h is requantised there)."""
    N, H = x_sorted.shape
    E, I, _ = w_gate.shape
    for name, w, s, shape in (("w_gate", w_gate, s_gate, (I, H)), ("w_up", w_up, s_up, (I, H)),
                              ("w_down", w_down, s_down, (H, I))):
        _check(w, s, shape, 128 if name != "w_down" else block_n_down, block_k, name)
        if w.shape[0] != E or s.shape[0] != E:
            raise ValueError(f"{name} and its scale must have {E} experts, got {w.shape[0]} and {s.shape[0]}")
    fp8 = jnp.dtype(w_gate.dtype)
    if any(jnp.dtype(w.dtype) != fp8 for w in (w_up, w_down)):
        raise ValueError(f"w_gate, w_up and w_down must share one FP8 type, got {w_gate.dtype}, {w_up.dtype}, "
                         f"{w_down.dtype}")
    xq, xs = act_quant_triton(x_sorted, dtype=fp8)  # activations in the weights' FP8 type (fnuz on MI300X)
    f32 = jnp.float32
    return _moe(xq, xs, group_sizes, w_gate, s_gate.astype(f32), w_up, s_up.astype(f32), w_down, s_down.astype(f32),
                scaled=True, h_dtype=fp8, block_m=block_m, block_n=SB, block_k=block_k, block_n_down=block_n_down,
                block_k_down=block_k, num_warps=num_warps, num_stages=num_stages, out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "block_n_down", "block_k_down",
                                             "num_warps", "num_stages", "out_dtype"))
def fused_moe_triton(x_sorted, group_sizes, w_gate, w_up, w_down, *, block_m: int = 64, block_n: int = 128,
                     block_k: int = 64, block_n_down: int = 128, block_k_down: int = 64, num_warps: int = 4,
                     num_stages: int = 3, out_dtype=jnp.float32):
    """Routed-expert MLP in bf16 / f16 (the Pallas ``fused_moe``'s contract, without its shared-expert
    groups): x_sorted [N, H] rows grouped by expert, group_sizes [E], w_gate / w_up [E, H, I], w_down
    [E, I, H] (the model's [in, out] layout) -> [N, H] ``out_dtype``; dots in x's dtype, f32
    accumulation, h rounded to x's dtype between the two kernels (as the Pallas kernel)."""
    N, H = x_sorted.shape
    E, _, I = w_gate.shape
    for name, w, shape in (("w_gate", w_gate, (E, H, I)), ("w_up", w_up, (E, H, I)), ("w_down", w_down, (E, I, H))):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {shape} ([E, in, out])")
        if jnp.dtype(w.dtype) != jnp.dtype(x_sorted.dtype):
            raise ValueError(f"{name} is {w.dtype}, x_sorted {x_sorted.dtype}: one dtype for the dots")
    if group_sizes.shape != (E,):
        raise ValueError(f"group_sizes has shape {group_sizes.shape}, expected ({E},)")
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k),
                    ("block_n_down", block_n_down), ("block_k_down", block_k_down)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two, at least 16 (Triton's dot minimum)")
    if block_k_down > block_n:
        raise ValueError(f"block_k_down={block_k_down} must not exceed block_n={block_n} (h is padded to block_n)")
    one = jnp.zeros((1,), jnp.float32)  # the scale pointers an unscaled launch does not read
    return _moe(x_sorted, one, group_sizes, w_gate, one, w_up, one, w_down, one, scaled=False,
                h_dtype=x_sorted.dtype, block_m=block_m, block_n=block_n, block_k=block_k,
                block_n_down=block_n_down, block_k_down=block_k_down, num_warps=num_warps, num_stages=num_stages,
                out_dtype=out_dtype)


def _moe(x, xs, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, *, scaled, h_dtype, block_m, block_n,
         block_k, block_n_down, block_k_down, num_warps, num_stages, out_dtype):
    """The two launches of either form: rows grouped into ``block_m`` tiles of one expert, gate/up (with
    SiLU and, scaled, h's requantisation), then down into each row's place."""
    N, H = x.shape
    # Weight strides of one expert (output dim, input dim): FP8 in HF's [out, in], bf16 in [in, out].
    if scaled:
        I = w_gate.shape[1]
        gate_strides, down_strides = dict(SWN=H, SWK=1), dict(SWN=I, SWK=1)
    else:
        I = w_gate.shape[2]
        gate_strides, down_strides = dict(SWN=1, SWK=I), dict(SWN=1, SWK=H)
    BM, BN = block_m, block_n
    tile_expert, row_src, out_pos, out_valid = moe_align_block_size(group_sizes, N, BM)
    T = tile_expert.shape[0]
    # Padding rows point past the last row (masked in both kernels) instead of at row 0.
    pad_ok = jnp.zeros((T * BM,), bool).at[jnp.where(out_valid, out_pos, T * BM)].set(True, mode="drop")
    src = jnp.where(pad_ok, row_src, N).astype(jnp.int32)
    I_pad = pl.cdiv(I, BN) * BN
    hs_shape = (T * BM, I_pad // SB) if scaled else (1,)
    h, hs = triton_call(
        x, xs, src, tile_expert, w_gate, s_gate, w_up, s_up, kernel=_gate_up_kernel,
        out_shape=(jax.ShapeDtypeStruct((T * BM, I_pad), h_dtype), jax.ShapeDtypeStruct(hs_shape, jnp.float32)),
        grid=(T, I_pad // BN), num_warps=num_warps, num_stages=num_stages,
        name="moe_block_fp8_gate_up" if scaled else "moe_gate_up", N_ROWS=N, H=H, I=I, I_PAD=I_pad, BM=BM, BN=BN,
        BK=block_k, SCALED=scaled, **gate_strides, **_fp8_grid(h_dtype if scaled else FP8))
    return triton_call(
        h, hs, src, tile_expert, w_down, s_down, kernel=_down_kernel,
        out_shape=jax.ShapeDtypeStruct((N, H), jnp.dtype(out_dtype)), zeroed_outputs=(0,),
        grid=(T, pl.cdiv(H, block_n_down)), num_warps=num_warps, num_stages=num_stages,
        name="moe_block_fp8_down" if scaled else "moe_down", N_ROWS=N, H=H, I=I, I_PAD=I_pad, BM=BM,
        BN=block_n_down, BK=block_k_down, SCALED=scaled, **down_strides)
