"""Block-FP8 kernels (pallas_kernels/fused_moe_fp8.py, block_scaled_matmul.py) in the Pallas
interpreter against float64 NumPy references over the dequantised weights, the XLA fallbacks, the
e4m3fn -> e4m3fnuz conversion and in-kernel integer decode (all 256 codes), selection, and lowering
to Triton IR for cuda and rocm (IR only: no GPU here, no PTX / HSACO built, no AMD GPU run).

Inputs are fresh random draws each run; every assertion message names the seed. Rerun a failure
with MOEJAX_TEST_SEED=<base seed> (printed as base=...)."""

from __future__ import annotations

import functools
import os
import secrets
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax.kernels import common, fp8_gemm, moe_fp8
from moejax.kernels.common import kernel_mode
from moejax.layers.fp8_linear import fp8_linear
from moejax.weights.fp8 import dequantize_block_fp8, e4m3fn_to_e4m3fnuz, quantize_block_fp8
from pallas_kernels.block_scaled_matmul import block_scaled_matmul
from pallas_kernels.fp8_utils import act_quant, check_blocks, decode_e4m3_bits
from pallas_kernels.fused_moe_fp8 import fused_moe_fp8

BF16 = jnp.bfloat16
BASE_SEED = int(os.environ.get("MOEJAX_TEST_SEED", secrets.randbits(31)))
W8A8_ERRORS: dict[str, float] = {}  # case -> rel. error of W8A8 vs the unquantised-activation reference


def seed_for(*key) -> int:
    return (BASE_SEED + zlib.crc32(repr(key).encode())) % (1 << 31)


def where(seed) -> str:
    return f"seed={seed} base={BASE_SEED} (MOEJAX_TEST_SEED={BASE_SEED} reproduces)"


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------ references
def hf_weight(rng, out, inn):
    """float32 [out, in] with a different magnitude in every 128 x 128 block (so a wrong scale index shows)."""
    w = rng.standard_normal((out, inn)).astype(np.float32) / inn ** 0.5
    mag = np.exp(rng.uniform(-1.5, 1.5, (-(-out // 128), -(-inn // 128)))).astype(np.float32)
    return w * np.repeat(np.repeat(mag, 128, 0), 128, 1)[:out, :inn]


def quantized_stack(rng, E, inn, out):
    """Experts quantised in HF's layout [out, in], then stored as moejax does: weight [E, in, out],
    scale [E, cdiv(in,128), cdiv(out,128)]. Returns (fp8 weights, scales, float64 dequantised [E, in, out])."""
    qs, ss, ds = [], [], []
    for _ in range(E):
        q, s = quantize_block_fp8(hf_weight(rng, out, inn))
        qs.append(q.T), ss.append(s.T), ds.append(dequantize_block_fp8(q, s, (128, 128)).T.astype(np.float64))
    return np.stack(qs), np.stack(ss), np.stack(ds)


def np_act_qdq(x):
    """NumPy per-token per-128 quantise -> dequantise (float32 arithmetic, ml_dtypes RTNE), float64 out."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    G = -(-K // 128)
    xp = np.zeros((M, G * 128), np.float32)
    xp[:, :K] = x
    xg = xp.reshape(M, G, 128)
    s = (np.maximum(np.abs(xg).max(-1), np.float32(1e-10)) * np.float32(1 / 448)).astype(np.float32)
    q = (xg / s[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float64) * s[..., None]).reshape(M, G * 128)[:, :K]


def moe_ref(x, group_sizes, wg, wu, wd, a8=False):
    x = np.asarray(x, np.float64)
    out, s = np.zeros((x.shape[0], wd.shape[-1])), 0
    for e, g in enumerate(group_sizes):
        xe = x[s:s + g]
        if a8 and g:
            xe = np_act_qdq(xe)
        a, b = xe @ wg[e], xe @ wu[e]
        h = a / (1 + np.exp(-a)) * b
        if a8 and g:
            h = np_act_qdq(h)
        out[s:s + g] = h @ wd[e]
        s += g
    return out


def moe_case(seed, N, H, I, group_sizes):
    rng = np.random.default_rng(seed)
    E = len(group_sizes)
    x = jnp.asarray(rng.standard_normal((N, H)) * np.exp(rng.uniform(-1, 1, (N, 1))), BF16)  # token scales vary
    g, u, d = quantized_stack(rng, E, H, I), quantized_stack(rng, E, H, I), quantized_stack(rng, E, I, H)
    return x, jnp.asarray(group_sizes, jnp.int32), g, u, d


def as_format(q, s, fmt):
    """The stored weight for each weight_format: fn as is, fnuz via e4m3fn_to_e4m3fnuz (scales x 2), fn bytes."""
    if fmt == "e4m3fnuz_bits":
        qz, sz = e4m3fn_to_e4m3fnuz(q, s)
        return jnp.asarray(qz.view(np.uint8)), jnp.asarray(sz)
    if fmt == "e4m3fn_bits":
        return jnp.asarray(q.view(np.uint8)), jnp.asarray(s)
    return jnp.asarray(q), jnp.asarray(s)


# ------------------------------------------------------------------ FP8 formats
def test_e4m3fn_to_e4m3fnuz_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    fn = codes.view(ml_dtypes.float8_e4m3fn)
    uz, scale = e4m3fn_to_e4m3fnuz(fn, np.float32([0.75]))
    assert uz.dtype == ml_dtypes.float8_e4m3fnuz and scale[0] == 1.5
    ub = uz.view(np.uint8)
    f_fn, f_uz = fn.astype(np.float64), uz.astype(np.float64)
    nan = np.isnan(f_fn)
    assert list(codes[nan]) == [0x7F, 0xFF] and np.all(ub[nan] == 0x80) and np.all(np.isnan(f_uz[nan]))
    assert ub[0x80] == 0x00  # -0 (fn) -> +0; 0x80 would be NaN in fnuz
    for c in codes[~nan]:
        assert f_uz[c] * 2 == f_fn[c], (hex(c), f_uz[c], f_fn[c])
    assert not np.any(np.isnan(f_uz[~nan]))
    assert np.all(ub[~nan & (codes != 0x80)] == codes[~nan & (codes != 0x80)])  # other bits unchanged
    # the real values of a quantised weight survive the conversion exactly
    seed = seed_for("fnuz")
    q, s = quantize_block_fp8(hf_weight(np.random.default_rng(seed), 200, 300))
    qz, sz = e4m3fn_to_e4m3fnuz(q, s)
    np.testing.assert_array_equal(dequantize_block_fp8(qz, sz, (128, 128)), dequantize_block_fp8(q, s, (128, 128)),
                                  err_msg=where(seed))


@pytest.mark.parametrize("fmt,dt", [("e4m3fn_bits", ml_dtypes.float8_e4m3fn),
                                    ("e4m3fnuz_bits", ml_dtypes.float8_e4m3fnuz)])
def test_integer_decode_bit_exact(fmt, dt):
    """The kernels' integer decode (uint8 -> float32 by bit fields) against ml_dtypes, all 256 codes."""
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(lambda c: decode_e4m3_bits(c, fmt))(codes))
    ref = codes.view(dt).astype(np.float32)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), [hex(c) for c in codes[~same]]


def test_act_quant_matches_numpy():
    seed = seed_for("act_quant")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((7, 300)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (7, 1))).astype(np.float32)
    x[3, 128:256] = 0.0  # an all-zero group: finite scale, zeros back
    q, s = act_quant(jnp.asarray(x))
    assert q.shape == (7, 300) and q.dtype == jnp.float8_e4m3fn and s.shape == (7, 3) and s.dtype == jnp.float32
    deq = np.asarray(q, np.float64) * np.repeat(np.asarray(s), 128, 1)[:, :300]
    np.testing.assert_array_equal(deq, np_act_qdq(x), err_msg=where(seed))
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0
    assert np.all(np.isfinite(np.asarray(s))) and not np.any(deq[3, 128:256])


# ------------------------------------------------------------------ fused MoE
MOE_CASES = [  # N, H, I, group sizes, (block_m, block_n, block_k, block_n_down, block_k_down)
    (13, 200, 136, [3, 0, 7, 2], (16, 16, 32, 32, 16)),        # odd H, I (2 cut scale blocks), empty expert, spare row
    (40, 256, 256, [0, 17, 0, 23], (16, 128, 128, 256, 64)),    # aligned; 128-wide tile (requant in kernel), 256 down
    (1, 48, 40, [0, 1, 0], (16, 64, 16, 16, 16)),                # one token, dims in one scale block, tile wider than I
    (70, 136, 264, [0, 33, 0, 20, 17], (32, 256, 64, 128, 32)),  # 256-wide gate/up tile over 3 cut scale blocks
]


@pytest.mark.parametrize("variant", ["w8a16", "w8a8"])
@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_fused_moe_fp8_matches_reference(case, variant):
    N, H, I, gs, (bm, bn, bk, bn2, bk2) = MOE_CASES[case]
    seed = seed_for("moe", case)
    x, g_sz, (qg, sg, dg), (qu, su, du), (qd, sd, dd) = moe_case(seed, N, H, I, gs)
    y = fused_moe_fp8(x, g_sz, jnp.asarray(qg), jnp.asarray(sg), jnp.asarray(qu), jnp.asarray(su), jnp.asarray(qd),
                      jnp.asarray(sd), variant=variant, block_m=bm, block_n=bn, block_k=bk, block_n_down=bn2,
                      block_k_down=bk2, interpret=True)
    n = sum(gs)
    assert y.shape == (N, H) and y.dtype == jnp.float32
    assert not np.any(np.asarray(y[n:])), where(seed)  # rows outside the groups: zeros
    a8 = variant == "w8a8"
    ref = moe_ref(x, gs, dg, du, dd, a8=a8)[:n]
    err = rel_err(y[:n], ref)
    # w8a16: only h's rounding to bf16 differs; w8a8: h's requantisation may flip a few codes by one step
    assert err < (1e-2 if a8 else 5e-3), f"rel err {err:.2e}, {where(seed)}"
    if a8:
        unq = rel_err(y[:n], moe_ref(x, gs, dg, du, dd)[:n])
        W8A8_ERRORS[f"moe case {case}"] = unq
        print(f"\nW8A8 fused MoE case {case}: {err:.2e} vs same-quantisation reference, {unq:.2e} vs unquantised "
              f"activations ({where(seed)})")
        # The quantisation error itself (e4m3 keeps 3 mantissa bits: ~3% a value, through two GEMMs and
        # a requantised h) varies with the draw: 0.090 for MOEJAX_TEST_SEED=698069527, so the bound is 0.15;
        # the kernel's own check is the same-quantisation reference above.
        assert 2e-3 < unq < 0.15, f"W8A8 vs unquantised activations {unq:.3f}, {where(seed)}"


@pytest.mark.parametrize("variant,cdt", [("w8a16", None), ("w8a8", None), ("w8a16", "float16")])
@pytest.mark.parametrize("case", [0, 3])
def test_fused_moe_fp8_nk_layout(case, variant, cdt):
    """HF's [E, out, in] weight layout (weight_layout="nk") and the f16 dot: the reference's error bound."""
    N, H, I, gs, (bm, bn, bk, bn2, bk2) = MOE_CASES[case]
    seed = seed_for("moe", case)
    x, g_sz, (qg, sg, dg), (qu, su, du), (qd, sd, dd) = moe_case(seed, N, H, I, gs)
    t = [jnp.asarray(np.swapaxes(a, 1, 2)) for a in (qg, sg, qu, su, qd, sd)]
    y = fused_moe_fp8(x, g_sz, *t, variant=variant, weight_layout="nk", compute_dtype=cdt, block_m=bm, block_n=bn,
                      block_k=bk, block_n_down=bn2, block_k_down=bk2, interpret=True)
    n = sum(gs)
    a8 = variant == "w8a8"
    err = rel_err(y[:n], moe_ref(x, gs, dg, du, dd, a8=a8)[:n])
    assert err < (1e-2 if a8 else 5e-3) and not np.any(np.asarray(y[n:])), f"rel err {err:.2e}, {where(seed)}"
    with pytest.raises(ValueError, match="w_gate has shape"):  # the kn arrays under the nk flag
        fused_moe_fp8(x, g_sz, *map(jnp.asarray, (qg, sg, qu, su, qd, sd)), weight_layout="nk", interpret=True)


@pytest.mark.parametrize("case,fmt", [(0, "e4m3fn_bits"), (3, "e4m3fnuz_bits")])
def test_fused_moe_fp8_integer_decode(case, fmt):
    """W8A16 with the weights as uint8 codes decoded in the kernel (ROCm's fnuz route; fn bytes)."""
    N, H, I, gs, (bm, bn, bk, bn2, bk2) = MOE_CASES[case]
    seed = seed_for("moe", case)  # the draw of the e4m3fn test: the same real weights
    x, g_sz, (qg, sg, dg), (qu, su, du), (qd, sd, dd) = moe_case(seed, N, H, I, gs)
    args = [a for q, s in ((qg, sg), (qu, su), (qd, sd)) for a in as_format(q, s, fmt)]
    y = fused_moe_fp8(x, g_sz, *args, weight_format=fmt, block_m=bm, block_n=bn, block_k=bk, block_n_down=bn2,
                      block_k_down=bk2, interpret=True)
    n = sum(gs)
    err = rel_err(y[:n], moe_ref(x, gs, dg, du, dd)[:n])
    assert err < 5e-3 and not np.any(np.asarray(y[n:])), f"rel err {err:.2e}, {where(seed)}"


def test_fused_moe_fp8_rejects_bad_blocks_and_scales():
    x, gs, (qg, sg, _), (qu, su, _), (qd, sd, _) = moe_case(seed_for("bad"), 4, 40, 24, [2, 2])
    w = [jnp.asarray(a) for a in (qg, sg, qu, su, qd, sd)]
    with pytest.raises(ValueError, match="block_k"):
        fused_moe_fp8(x, gs, *w, block_k=256, interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        fused_moe_fp8(x, gs, *w, block_n=48, interpret=True)
    with pytest.raises(ValueError, match="s_gate"):
        fused_moe_fp8(x, gs, w[0], w[1][:, :, :0], *w[2:], interpret=True)
    with pytest.raises(ValueError, match="w8a8"):
        fused_moe_fp8(x, gs, *[jnp.asarray(np.asarray(a).view(np.uint8)) if i % 2 == 0 else a for i, a in enumerate(w)],
                      variant="w8a8", weight_format="e4m3fn_bits", interpret=True)


# ------------------------------------------------------------------ dense block-scaled GEMM
MM_CASES = [  # M, K, N, (block_m, block_n, block_k, num_splits)
    (5, 300, 200, (16, 16, 32, 1)),     # every dim cut by the edge, 2-3 scale blocks
    (32, 256, 384, (16, 128, 128, 1)),  # aligned: slice loads
    (17, 640, 72, (16, 256, 64, 3)),    # 256-wide tile over 1 cut scale block, K split in 3 (2+2+1 blocks)
    (20, 1000, 130, (32, 64, 128, 4)),  # ragged K in the last split, N just past a block
    (32, 48, 128, (16, 128, 64, 1)),    # K below one K step (tiny models): only the ragged step
]


@pytest.mark.parametrize("variant", ["w8a16", "w8a8"])
@pytest.mark.parametrize("case", range(len(MM_CASES)))
def test_block_scaled_matmul_matches_reference(case, variant):
    M, K, N, (bm, bn, bk, sp) = MM_CASES[case]
    seed = seed_for("mm", case)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.exp(rng.uniform(-1, 1, (M, 1))), BF16)
    q, s = quantize_block_fp8(hf_weight(rng, N, K))
    d = dequantize_block_fp8(q, s, (128, 128)).astype(np.float64)
    a8 = variant == "w8a8"
    xr = np.asarray(x, np.float64)
    ref = (np_act_qdq(xr) if a8 else xr) @ d.T
    y = block_scaled_matmul(x, jnp.asarray(q), jnp.asarray(s), variant=variant, out_dtype=jnp.float32, block_m=bm,
                            block_n=bn, block_k=bk, num_splits=sp, interpret=True)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    err = rel_err(y, ref)
    assert err < 1e-5, f"rel err {err:.2e}, {where(seed)}"  # same operands, f32 accumulation
    if case == 2:  # output in x's dtype (the split partials summed in f32 first)
        yb = block_scaled_matmul(x, jnp.asarray(q), jnp.asarray(s), variant=variant, block_m=bm, block_n=bn,
                                 block_k=bk, num_splits=sp, interpret=True)
        assert yb.dtype == BF16 and rel_err(yb, ref) < 5e-3, where(seed)
    if a8:
        unq = rel_err(y, xr @ d.T)
        W8A8_ERRORS[f"gemm case {case}"] = unq
        print(f"\nW8A8 GEMM case {case}: {err:.2e} vs same-quantisation reference, {unq:.2e} vs unquantised "
              f"activations ({where(seed)})")
        assert 2e-3 < unq < 0.06, f"W8A8 vs unquantised activations {unq:.3f}, {where(seed)}"
    elif case == 3:
        for fmt in ("e4m3fnuz_bits", "e4m3fn_bits"):
            yf = block_scaled_matmul(x, *as_format(q, s, fmt), weight_format=fmt, out_dtype=jnp.float32, block_m=bm,
                                     block_n=bn, block_k=bk, num_splits=sp, interpret=True)
            assert rel_err(yf, ref) < 1e-5, f"{fmt}: {where(seed)}"


# ------------------------------------------------------------------ XLA fallbacks and entry points
def test_xla_fallbacks_match_reference():
    seed = seed_for("xla")
    rng = np.random.default_rng(seed)
    M, K, N = 9, 300, 200
    x = jnp.asarray(rng.standard_normal((3, M // 3, K)), BF16)  # leading dims are flattened
    q, s = quantize_block_fp8(hf_weight(rng, N, K))
    d = dequantize_block_fp8(q, s, (128, 128)).astype(np.float64)
    deq = jax.jit(fp8_gemm.dequantize_fp8)
    np.testing.assert_array_equal(np.asarray(deq(jnp.asarray(q), jnp.asarray(s))), d.astype(np.float32))
    qz, sz = e4m3fn_to_e4m3fnuz(q, s)
    np.testing.assert_array_equal(np.asarray(deq(jnp.asarray(qz), jnp.asarray(sz))), d.astype(np.float32))
    xr = np.asarray(x, np.float64).reshape(M, K)
    for variant, ref in (("w8a16", xr @ d.T), ("w8a8", np_act_qdq(xr) @ d.T)):
        y = jax.jit(functools.partial(fp8_gemm.xla, variant=variant, out_dtype=jnp.float32))(
            x, jnp.asarray(q), jnp.asarray(s))
        assert y.shape == (3, M // 3, N)
        assert rel_err(y.reshape(M, N), ref) < 1e-5, f"{variant} {where(seed)}"  # float32 operands on CPU
    N2, H, I, gs = 13, 200, 136, [3, 0, 7, 2]
    x2, g_sz, (qg, sg, dg), (qu, su, du), (qd, sd, dd) = moe_case(seed, N2, H, I, gs)
    w = [jnp.asarray(np.swapaxes(a, 1, 2)) for a in (qg, sg, qu, su, qd, sd)]  # the model's [E, out, in]
    for variant in ("w8a16", "w8a8"):
        y = jax.jit(functools.partial(moe_fp8.xla, variant=variant))(x2, g_sz, *w)
        ref = moe_ref(x2, gs, dg, du, dd, a8=variant == "w8a8")
        assert rel_err(y[:12], ref[:12]) < (2e-3 if variant == "w8a8" else 1e-5), f"{variant} {where(seed)}"
        assert not np.any(np.asarray(y[12:]))
    # "bf16" (auto at prefill sizes): the weights dequantised to x's dtype, then the bf16 MLP (XLA and the
    # Pallas kernel): W8A16's numbers up to x's dtype
    ref = moe_ref(x2, gs, dg, du, dd, a8=False)
    for mode in ("xla", "pallas"):
        y = jax.jit(lambda *a: moe_fp8.run(*a, variant="bf16", mode=mode))(x2, g_sz, *w)
        tol = 1e-5 if x2.dtype == jnp.float32 else 1e-2
        assert rel_err(y[:12], ref[:12]) < tol and not np.any(np.asarray(y[12:])), f"bf16 {mode} {where(seed)}"


def test_entry_points_kernel_vs_xla():
    """``fp8_linear`` / ``grouped_mlp_fp8``: "xla" (the CPU default) and forced "pallas" agree, for
    e4m3fn weights and for float8_e4m3fnuz weights (the kernel reads their bytes)."""
    seed = seed_for("entry")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 7, 300)), BF16)
    q, s = quantize_block_fp8(hf_weight(rng, 200, 300))
    qz, sz = e4m3fn_to_e4m3fnuz(q, s)
    with kernel_mode("auto"):
        assert fp8_gemm.pallas_plan(14, 200, 300, BF16, q.dtype).path == "xla"  # CPU
    for w, sc, variants in ((q, s, ("w8a16", "w8a8")), (qz, sz, ("w8a16",))):
        for variant in variants:
            ref = jax.jit(lambda a, b, c: fp8_linear(a, b, c, variant, mode="xla"))(x, jnp.asarray(w), jnp.asarray(sc))
            with kernel_mode("pallas"):
                got = jax.jit(lambda a, b, c: fp8_linear(a, b, c, variant))(x, jnp.asarray(w), jnp.asarray(sc))
            assert got.shape == ref.shape == (2, 7, 200) and got.dtype == BF16
            assert rel_err(got, ref) < 1e-2, f"{variant} {w.dtype} {where(seed)}"
    N, H, I, gs = 20, 136, 200, [5, 0, 9, 4]
    x2, g_sz, (qg, sg, _), (qu, su, _), (qd, sd, _) = moe_case(seed, N, H, I, gs)
    for fnuz, variants in ((False, ("w8a16",)), (True, ("w8a16",))):  # (w8a8 MoE: the kernel tests)
        w = [jnp.swapaxes(a, 1, 2) for qq, ss in ((qg, sg), (qu, su), (qd, sd))  # the model's [E, out, in]
             for a in ((jnp.asarray(e4m3fn_to_e4m3fnuz(qq, ss)[0]), jnp.asarray(ss * 2)) if fnuz else
                       (jnp.asarray(qq), jnp.asarray(ss)))]
        for variant in variants:
            ref = jax.jit(lambda *a: moe_fp8.run(*a, variant=variant, mode="xla"))(x2, g_sz, *w)
            with kernel_mode("pallas"):
                got = jax.jit(lambda *a: moe_fp8.run(*a, variant=variant))(x2, g_sz, *w)
            assert rel_err(got[:18], ref[:18]) < 1.5e-2, f"{variant} fnuz={fnuz} {where(seed)}"


# ------------------------------------------------------------------ selection
def test_fp8_variant_auto(monkeypatch):
    """fp8_variant "auto" (the default) on CUDA with e4m3fn weights: expert GEMMs W8A16 below
    W8A8_MIN_ROWS_PER_EXPERT rows an expert, W8A8 from there, dequantised bf16 from BF16_MIN_ROWS_PER_EXPERT;
    dense GEMMs W8A8 for DENSE_W8A8_ROWS rows, else W8A16; W8A16 on ROCm / fnuz weights and on CPU; an
    explicit variant passes through."""
    from moejax.layers.fp8_policy import Fp8Policy
    FN, FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
    monkeypatch.setenv(common.W8A8_KERNEL_ENV, "pallas")  # the Pallas family's thresholds (Triton's below)
    n = moe_fp8.W8A8_MIN_ROWS_PER_EXPERT
    assert Fp8Policy.create("default").variant == "auto"
    assert moe_fp8.pick_variant("auto", 32 * n, 32, FN) == "w8a16"  # CPU
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    assert moe_fp8.pick_variant("auto", 32 * n, 32, FN) == "w8a8"
    assert moe_fp8.pick_variant("auto", 32 * n - 1, 32, FN) == "w8a16"
    b = moe_fp8.BF16_MIN_ROWS_PER_EXPERT  # prefill sizes: dequantised weights, the bf16 kernel
    assert moe_fp8.pick_variant("auto", 32 * b, 32, FN) == "bf16"
    assert moe_fp8.pick_variant("auto", 32 * b - 1, 32, FN) == "w8a8"
    lo, hi = fp8_gemm.DENSE_W8A8_ROWS  # dense: W8A8 kernel in the range, W8A16 (kernel / XLA) outside it
    assert [moe_fp8.pick_variant("auto", m, 1, FN) for m in (64, lo, hi, hi + 1)] == ["w8a16", "w8a8", "w8a8", "w8a16"]
    assert fp8_gemm.pallas_plan(lo, 7168, 7168, BF16, FN, "w8a8").path == "pallas"
    assert fp8_gemm.pallas_plan(hi + 1, 7168, 7168, BF16, FN, "w8a16").path == "xla"
    assert moe_fp8.pick_variant("auto", 32 * n, 32, FNUZ) == "w8a16"
    for v in ("w8a16", "w8a8"):
        assert moe_fp8.pick_variant(v, 32, 32, FN) == v
    monkeypatch.setenv(common.W8A8_KERNEL_ENV, "triton")  # W8A8 from fewer rows, no dequantised range
    t, _ = moe_fp8.MOE_FP8_THRESHOLDS["triton"]
    assert [moe_fp8.pick_variant("auto", 32 * r, 32, FN) for r in (t - 1, t, 4096)] == ["w8a16", "w8a8", "w8a8"]
    monkeypatch.setattr(common, "platform", lambda: "rocm")
    assert moe_fp8.pick_variant("auto", 32 * n, 32, FN) == "w8a16"
    with pytest.raises(ValueError, match="fp8_variant"):
        Fp8Policy.create("default", variant="w4a4")


def test_fp8_selection(monkeypatch):
    FN, FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
    with kernel_mode("auto"):  # CPU: XLA
        assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, FN).path == "xla"
        assert fp8_gemm.pallas_plan(64, 1536, 7168, BF16, FN).path == "xla"
    for gpu in ("cuda", "rocm"):
        monkeypatch.setattr(common, "platform", lambda gpu=gpu: gpu)
        with kernel_mode("auto"):
            for variant in ("w8a16", "w8a8"):
                for t in (8, 32, 128, 512):
                    c = moe_fp8.pallas_plan(32 * t, 32, 7168, 2048, BF16, FN, variant)
                    if gpu == "rocm" and variant == "w8a8":
                        assert c.path == "xla" and "fnuz" in c.reason
                        continue
                    p = c.params
                    assert c.path == "pallas" and p["variant"] == variant
                    assert p["weight_format"] == ("e4m3fn" if gpu == "cuda" else "e4m3fn_bits")
                    check_blocks(p["block_n"], p["block_k"])
                    check_blocks(p["block_n_down"], min(p["block_k_down"], p["block_n"], 128))
                    if variant == "w8a8":
                        assert p["block_n"] == 128 and p["block_k"] == 128  # requant in the epilogue
            assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, FNUZ).params["weight_format"] == "e4m3fnuz_bits"
            assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, jnp.uint8).params["weight_format"] == "e4m3fnuz_bits"
            assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, FNUZ, "w8a8").path == "xla"
            assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, BF16).path == "xla"  # not FP8 weights
            for K, N in ((7168, 1536), (1536, 24576), (7168, 576), (16384, 7168)):
                for M in (1, 20, 64, 256, 1024):
                    c = fp8_gemm.pallas_plan(M, N, K, BF16, FN)
                    if M > 64 and gpu == "cuda":  # XLA measured faster there (H200)
                        assert c.path == "xla", (M, N, K)
                        with kernel_mode("pallas"):
                            c = fp8_gemm.pallas_plan(M, N, K, BF16, FN)
                    p = c.params
                    assert c.path == "pallas", (M, N, K)
                    check_blocks(p["block_n"], p["block_k"])
                    assert all(p[b] >= 16 and p[b] & (p[b] - 1) == 0 for b in ("block_m", "block_n", "block_k"))
                    assert 1 <= p["num_splits"] <= -(-K // 128)
                    tiles = -(-M // p["block_m"]) * -(-N // p["block_n"])
                    assert p["num_splits"] == 1 or tiles < 132
            assert fp8_gemm.pallas_plan(64, 576, 7168, BF16, FN).params["num_splits"] > 1  # kv_a: 9 column tiles
            assert fp8_gemm.pallas_plan(64, 24576, 1536, BF16, FN).params["num_splits"] == 1
        monkeypatch.undo()
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    monkeypatch.setattr(jax, "devices", lambda *a: [type("D", (), {"compute_capability": "8.0"})()])
    with kernel_mode("auto"):  # an A100: no FP8 casts, so the integer decode, and no w8a8
        assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, FN).params["weight_format"] == "e4m3fn_bits"
        assert moe_fp8.pallas_plan(256, 32, 7168, 2048, BF16, FN, "w8a8").path == "xla"
        assert fp8_gemm.pallas_plan(64, 1536, 7168, BF16, FN).params["weight_format"] == "e4m3fn_bits"


# ---------------------------------------------------------- Triton lowering (IR only)
def test_fnuz_cast_is_not_lowerable():
    """Why the fnuz route decodes bytes: Pallas-Triton refuses casts from float8_e4m3fnuz."""
    from jax.experimental import pallas as pl
    from pallas_kernels.compat import compiler_params

    def k(w_ref, o_ref):
        o_ref[...] = w_ref[...].astype(BF16)

    f = lambda w: pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((16, 16), BF16),
                                 compiler_params=compiler_params(4, 1), interpret=False)(w)
    try:
        jax.jit(f).trace(jax.ShapeDtypeStruct((16, 16), jnp.float8_e4m3fnuz)).lower(lowering_platforms=("rocm",))
    except NotImplementedError as e:
        assert "fnuz" in str(e)
    else:
        pytest.skip("this jax lowers fnuz casts: the e4m3fnuz_bits route is no longer the only one")


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_fp8_kernels_lower_to_triton(platform, monkeypatch):
    """Pallas -> Triton IR at DeepSeek-V3 shapes with the blocks ``select_*_fp8`` picks on that
    platform (not compiled to PTX / HSACO: no GPU here)."""
    monkeypatch.setattr(common, "platform", lambda: platform)
    S = jax.ShapeDtypeStruct
    E, H, I = 32, 7168, 2048
    formats = [(jnp.float8_e4m3fn, "w8a16"), (jnp.uint8, "w8a16")] + \
        ([(jnp.float8_e4m3fn, "w8a8")] if platform == "cuda" else [])
    for wdt, variant in formats:
        for N in (256, 16384):
            with kernel_mode("auto"):
                c = moe_fp8.pallas_plan(N, E, H, I, BF16, wdt, variant)
            assert c.path == "pallas"
            f = functools.partial(fused_moe_fp8, **c.params, interpret=False)
            text = jax.jit(f).trace(S((N, H), BF16), S((E,), jnp.int32), S((E, H, I), wdt), S((E, 56, 16), jnp.float32),
                                    S((E, H, I), wdt), S((E, 56, 16), jnp.float32), S((E, I, H), wdt),
                                    S((E, 16, 56), jnp.float32)).lower(lowering_platforms=(platform,)).as_text()
            assert text.count("xla.gpu.triton") == 2, (variant, wdt, N)
        for M, K, Nout in ((64, 7168, 576), (1024, 1536, 24576)):
            with kernel_mode("pallas"):  # auto takes XLA above 64 rows on CUDA
                c = fp8_gemm.pallas_plan(M, Nout, K, BF16, wdt, variant)
            f = functools.partial(block_scaled_matmul, **c.params, interpret=False)
            text = jax.jit(f).trace(S((M, K), BF16), S((Nout, K), wdt),
                                    S((-(-Nout // 128), K // 128), jnp.float32)).lower(
                lowering_platforms=(platform,)).as_text()
            assert text.count("xla.gpu.triton") == 1, (variant, wdt, M)
    # odd sizes, every format the platform takes
    fmts = (("w8a16", "e4m3fn"), ("w8a16", "e4m3fnuz_bits"), ("w8a16", "e4m3fn_bits")) + \
        ((("w8a8", "e4m3fn"),) if platform == "cuda" else ())
    for variant, fmt in fmts:
        wdt = jnp.float8_e4m3fn if fmt == "e4m3fn" else jnp.uint8
        f = functools.partial(fused_moe_fp8, variant=variant, weight_format=fmt, block_n=128, interpret=False)
        jax.jit(f).trace(S((13, 200), BF16), S((4,), jnp.int32), S((4, 200, 136), wdt), S((4, 2, 2), jnp.float32),
                         S((4, 200, 136), wdt), S((4, 2, 2), jnp.float32), S((4, 136, 200), wdt),
                         S((4, 2, 2), jnp.float32)).lower(lowering_platforms=(platform,))
        f = functools.partial(block_scaled_matmul, variant=variant, weight_format=fmt, block_n=256, block_k=64,
                              num_splits=3, interpret=False)
        jax.jit(f).trace(S((17, 1000), BF16), S((130, 1000), wdt), S((2, 8), jnp.float32)).lower(
            lowering_platforms=(platform,))


def test_bench_fp8_script_smoke():
    """scripts/bench_fp8_kernels.py --smoke (tiny shapes, interpret mode) runs every case."""
    import subprocess
    import sys
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, f"{root}/scripts/bench_fp8_kernels.py", "--smoke"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused MoE FP8" in out.stdout and "block-scaled GEMM" in out.stdout
    assert "failed" not in out.stdout and out.stdout.count("w8a8") >= 4, out.stdout[-3000:]


def test_fp8_dots_lower_with_fast_accumulation():
    """pallas_kernels/triton_fp8_dots.py: the Triton module the W8A8 kernel lowers to (for CUDA, lowered
    here without a GPU) carries maxNumImpreciseAcc = 2**30 on its fp8 x fp8 dot (Hopper's wgmma; without
    it Triton emits mma.sync), and the W8A16 kernel's bf16 dot does not."""
    import functools
    import re

    from jax._src.pallas.triton import lowering as ptl

    from pallas_kernels import triton_fp8_dots
    from pallas_kernels.block_scaled_matmul import block_scaled_matmul
    assert triton_fp8_dots.install()
    modules, orig = [], ptl.lower_jaxpr_to_triton_module

    def hook(*args, **kw):
        res = orig(*args, **kw)
        modules.append(str(getattr(res, "module", res)))
        return res

    S = jax.ShapeDtypeStruct
    args = (S((32, 256), jnp.bfloat16), S((256, 256), jnp.float8_e4m3fn), S((2, 2), jnp.float32))
    ptl.lower_jaxpr_to_triton_module = hook
    try:
        for variant in ("w8a8", "w8a16"):
            fn = functools.partial(block_scaled_matmul, variant=variant, block_m=16, block_n=128, block_k=128,
                                   interpret=False)
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        ptl.lower_jaxpr_to_triton_module = orig
    assert len(modules) == 2, len(modules)
    w8a8, w8a16 = modules
    assert re.search(r"tt\.dot .*f8E4M3FN", w8a8) and "maxNumImpreciseAcc = 1073741824" in w8a8
    assert "bf16" in w8a16 and "maxNumImpreciseAcc = 1073741824" not in w8a16
