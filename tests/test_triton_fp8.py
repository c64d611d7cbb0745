"""The Triton-language W8A8 kernels (pallas_kernels/triton_block_fp8.py) against float64 NumPy
references with the same activation quantisation: on CPU in Triton's interpreter (needs ``triton`` and
``torch`` installed: ``pip install 'moejax[triton]' torch``; skipped otherwise, said in the skip
reason), on a GPU through jax-triton (``pytest tests/test_triton_fp8.py`` on the device machine).

Seeds as in test_fp8_kernels.py (MOEJAX_TEST_SEED replays a failure)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import common, fp8_gemm, moe, moe_fp8
from moejax.weights.fp8 import dequantize_block_fp8, quantize_block_fp8
from pallas_kernels import jax_triton_compat
from pallas_kernels.jax_triton_compat import available
from pallas_kernels.fp8_utils import act_quant
from pallas_kernels.triton_block_fp8 import act_quant_triton, block_fp8_matmul, fused_moe_block_fp8, fused_moe_triton
from test_fp8_kernels import BF16, hf_weight, moe_case, moe_ref, np_act_qdq, rel_err, seed_for, where

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
if ON_GPU:
    _ok, _why = available()
    pytestmark = pytest.mark.skipif(not _ok, reason=_why)
else:
    pytestmark = pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("triton", "torch")),
        reason="Triton's interpreter needs triton and torch (CPU); not installed here")

GEMM_CASES = [  # M, K, N, (block_m, block_n, block_k)
    (5, 300, 200, (16, 64, 64)),       # every dim cut by the edge, 2-3 scale blocks, 2 K steps a block
    (40, 256, 384, (32, 128, 128)),    # aligned
    (70, 48, 130, (16, 128, 128)),     # K below one K step, N just past a block, 5 row tiles
]


@pytest.mark.parametrize("case", range(len(GEMM_CASES)))
def test_block_fp8_matmul_matches_reference(case):
    M, K, N, (bm, bn, bk) = GEMM_CASES[case]
    seed = seed_for("triton-mm", case)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.exp(rng.uniform(-1, 1, (M, 1))), BF16)
    q, s = quantize_block_fp8(hf_weight(rng, N, K))
    d = dequantize_block_fp8(q, s, (128, 128)).astype(np.float64)
    ref = np_act_qdq(np.asarray(x, np.float64)) @ d.T
    y = block_fp8_matmul(x, jnp.asarray(q), jnp.asarray(s), out_dtype=jnp.float32, block_m=bm, block_n=bn,
                         block_k=bk, group_m=2)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    err = rel_err(y, ref)
    # same operands, f32 accumulation; the GPU's tensor cores sum each 128-deep FP8 step at their own
    # precision (Triton's sm_90 default, as in vLLM), so a looser bound there
    assert err < (2e-3 if ON_GPU else 1e-5), f"rel err {err:.2e}, {where(seed)}"
    if case == 1:
        yb = block_fp8_matmul(x, jnp.asarray(q), jnp.asarray(s), block_m=bm, block_n=bn, block_k=bk)
        assert yb.dtype == BF16 and rel_err(yb, ref) < 5e-3, where(seed)


MOE_CASES = [  # N, H, I, group sizes, (block_m, block_k, block_n_down)
    (13, 200, 136, [3, 0, 7, 2], (16, 64, 64)),      # odd H, I (cut scale blocks), empty expert, a spare row
    (40, 256, 256, [0, 17, 0, 23], (16, 128, 128)),  # aligned
    (70, 136, 264, [0, 33, 0, 20, 17], (32, 64, 128)),  # 3 cut blocks of I, several tiles an expert
]


@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_fused_moe_block_fp8_matches_reference(case):
    N, H, I, gs, (bm, bk, bn2) = MOE_CASES[case]
    seed = seed_for("triton-moe", case)
    x, g_sz, (qg, sg, dg), (qu, su, du), (qd, sd, dd) = moe_case(seed, N, H, I, gs)
    nk = [jnp.asarray(np.swapaxes(a, 1, 2)) for a in (qg, sg, qu, su, qd, sd)]  # HF's [E, out, in]
    y = fused_moe_block_fp8(x, g_sz, *nk, block_m=bm, block_k=bk, block_n_down=bn2)
    n = sum(gs)
    assert y.shape == (N, H) and y.dtype == jnp.float32
    assert not np.any(np.asarray(y[n:])), where(seed)  # rows outside the groups: zeros
    err = rel_err(y[:n], moe_ref(x, gs, dg, du, dd, a8=True)[:n])
    # h's requantisation may flip a few codes by one step (as the Pallas W8A8 kernel's bound)
    assert err < 1e-2, f"rel err {err:.2e}, {where(seed)}"


def test_act_quant_kernel_is_act_quant():
    """The one-pass Triton quantiser gives act_quant's codes and scales exactly (its division rounded to
    nearest, subnormal codes rounded once): rows across 8 decades, K cut by the group edge."""
    seed = seed_for("triton-act-quant")
    rng = np.random.default_rng(seed)
    for M, K in ((5, 300), (37, 1024)):
        x = jnp.asarray(rng.standard_normal((M, K)) * np.exp(rng.uniform(-9, 9, (M, 1))), BF16)
        q, s = act_quant_triton(x, block_m=16)
        q0, s0 = act_quant(x)
        assert q.dtype == q0.dtype and np.array_equal(np.asarray(s), np.asarray(s0)), where(seed)
        assert np.array_equal(np.asarray(q, np.float32), np.asarray(q0, np.float32)), where(seed)


def test_fused_moe_triton_bf16_matches_reference():
    """The same kernels unscaled (bf16 weights in the model's [E, in, out] layout): against float64 with h
    rounded to bf16 between the projections, as the Pallas fused_moe; cut dims, an empty expert, a spare
    row (zero), several tiles an expert."""
    seed = seed_for("triton-moe-bf16")
    rng = np.random.default_rng(seed)
    N, H, I, gs = 70, 136, 264, [0, 33, 0, 20, 16]
    E = len(gs)
    x = jnp.asarray(rng.standard_normal((N, H)), BF16)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, I)) / H ** 0.5, BF16) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / I ** 0.5, BF16)
    y = fused_moe_triton(x, jnp.asarray(gs, jnp.int32), wg, wu, wd, block_m=16, block_n=64, block_k=32,
                         block_n_down=64, block_k_down=32)
    xf, gf, uf, df = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    ref, s = np.zeros((N, H)), 0
    for e, c in enumerate(gs):
        a, b = xf[s:s + c] @ gf[e], xf[s:s + c] @ uf[e]
        h = np.asarray(jnp.asarray(a / (1 + np.exp(-a)) * b, BF16), np.float64)
        ref[s:s + c], s = h @ df[e], s + c
    n = sum(gs)
    assert y.shape == (N, H) and y.dtype == jnp.float32 and not np.any(np.asarray(y[n:])), where(seed)
    # h's bf16 rounding can differ by one step where f32 and float64 land either side of a tie
    assert rel_err(y[:n], ref[:n]) < (3e-3 if ON_GPU else 1e-4), f"rel err {rel_err(y[:n], ref[:n]):.2e}, {where(seed)}"
    with pytest.raises(ValueError, match="block_k_down"):
        fused_moe_triton(x, jnp.asarray(gs, jnp.int32), wg, wu, wd, block_n=32, block_k_down=64)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe_triton(x, jnp.asarray(gs, jnp.int32), wg, wu, wd[:, :, :8])


def test_bf16_moe_kernel_choice(monkeypatch):
    """MOEJAX_MOE_KERNEL: "pallas" (default: measured level or ahead, BENCHMARKS.md) fuses the shared experts;
    "triton" runs the routed experts through fused_moe_triton with the shared ones beside them (not fused)."""
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    args = (32, 7168, 2048, BF16)
    assert moe.moe_kernel() == "pallas" and moe.fuse_shared_experts(*args)
    monkeypatch.setenv(common.MOE_KERNEL_ENV, "triton")
    assert moe.moe_kernel() == "triton" and not moe.fuse_shared_experts(*args)
    monkeypatch.setenv(common.MOE_KERNEL_ENV, "cutlass")
    with pytest.raises(ValueError, match=common.MOE_KERNEL_ENV):
        moe.moe_kernel()


def test_bad_shapes_name_the_field():
    rng = np.random.default_rng(0)
    q, s = quantize_block_fp8(hf_weight(rng, 64, 96))
    x = jnp.ones((4, 96), BF16)
    with pytest.raises(ValueError, match="w's scale"):
        block_fp8_matmul(x, jnp.asarray(q), jnp.asarray(s[:, :0]))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_fp8_matmul(x, jnp.asarray(q, jnp.float32), jnp.asarray(s))
    with pytest.raises(ValueError, match="block_k"):
        block_fp8_matmul(x, jnp.asarray(q), jnp.asarray(s), block_k=256)


def test_selection_routes_w8a8_to_triton(monkeypatch):
    """On CUDA with jax-triton, W8A8 expert GEMMs run the Triton fused MoE (here in the interpreter, with
    the platform patched to "cuda") and give the reference's numbers; MOEJAX_W8A8_KERNEL=pallas keeps the
    Pallas kernel; W8A16 and dense projections never go to Triton."""
    from pallas_kernels import triton_block_fp8

    calls = []
    real = triton_block_fp8.fused_moe_block_fp8
    monkeypatch.setattr(moe_fp8, "fused_moe_block_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    monkeypatch.setattr(jax_triton_compat, "available", lambda: (True, ""))
    assert moe_fp8.w8a8_kernel() == "triton"
    N, H, I, gs = 40, 256, 256, [0, 17, 0, 23]
    seed = seed_for("triton-route")
    x, g_sz, (qg, sg, dg), (qu, su, du), (qd, sd, dd) = moe_case(seed, N, H, I, gs)
    nk = [jnp.asarray(np.swapaxes(a, 1, 2)) for a in (qg, sg, qu, su, qd, sd)]
    with common.kernel_mode("auto"):
        assert moe_fp8.plan(N, 4, H, I, x.dtype, nk[0].dtype, "w8a8").path == "triton"
        y = moe_fp8.run(x, g_sz, *nk, variant="w8a8")
        assert len(calls) == 1
        assert rel_err(y[:40], moe_ref(x, gs, dg, du, dd, a8=True)[:40]) < 1e-2, where(seed)
        assert moe_fp8.plan(N, 4, H, I, x.dtype, nk[0].dtype, "w8a16").path == "pallas"
        moe_fp8.run(x, g_sz, *nk, variant="w8a16")
        assert len(calls) == 1
        q, s = quantize_block_fp8(hf_weight(np.random.default_rng(seed), 384, 256))
        assert fp8_gemm.plan(N, 384, 256, x.dtype, q.dtype, "w8a8", mode="pallas").path == "pallas"
        fp8_gemm.run(x, jnp.asarray(q), jnp.asarray(s), "w8a8", mode="pallas")
        assert len(calls) == 1
        monkeypatch.setenv(common.W8A8_KERNEL_ENV, "pallas")
        assert moe_fp8.plan(N, 4, H, I, x.dtype, nk[0].dtype, "w8a8").path == "pallas"
        moe_fp8.run(x, g_sz, *nk, variant="w8a8")
        assert len(calls) == 1
        monkeypatch.setenv(common.W8A8_KERNEL_ENV, "cutlass")
        with pytest.raises(ValueError, match=common.W8A8_KERNEL_ENV):
            moe_fp8.w8a8_kernel()


_COMPILE = r"""
import json, os, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pallas_kernels import triton_block_fp8 as T


def compile_(*args, **kw):  # jax_triton empties TRITON_CACHE_DIR when (lazily) imported; compile needs one
    os.environ["TRITON_CACHE_DIR"] = os.environ["MOEJAX_TEST_TRITON_CACHE"]
    return triton.compile(*args, **kw)



out = {}
import jax.numpy as jnp
for arch, target, f8, jdt in (("gfx942", GPUTarget("hip", "gfx942", 64), "fp8e4b8", jnp.float8_e4m3fnuz),
                              ("sm_90", GPUTarget("cuda", 90, 32), "fp8e4nv", jnp.float8_e4m3fn)):
    ptrs = lambda names, types: dict(zip(names, types))
    gate = ptrs(("x_ptr", "xs_ptr", "src_ptr", "eid_ptr", "wg_ptr", "sg_ptr", "wu_ptr", "su_ptr", "h_ptr", "hs_ptr"),
                ("*" + f8, "*fp32", "*i32", "*i32", "*" + f8, "*fp32", "*" + f8, "*fp32", "*" + f8, "*fp32"))
    down = ptrs(("h_ptr", "hs_ptr", "src_ptr", "eid_ptr", "wd_ptr", "sd_ptr", "o_ptr"),
                ("*" + f8, "*fp32", "*i32", "*i32", "*" + f8, "*fp32", "*fp32"))
    dense = ptrs(("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "o_ptr"), ("*" + f8, "*fp32", "*" + f8, "*fp32", "*bf16"))
    shape = dict(N_ROWS=4096, H=7168, I=2048, I_PAD=2048, BM=64, BN=128, BK=128)
    for name, kern, sig, consts in (("gate_up", T._gate_up_kernel, gate,
                                     dict(shape, SWN=7168, SWK=1, SCALED=True, **T._fp8_grid(jdt))),
                                    ("down", T._down_kernel, down, dict(shape, SWN=2048, SWK=1, SCALED=True)),
                                    ("dense", T._dense_kernel, dense, dict(M=512, N=7168, K=7168, BM=64, BN=128,
                                                                           BK=128, GROUP_M=8))):
        src = ASTSource(kern.get(False), dict(sig, **{c: "constexpr" for c in consts}), consts)
        k = compile_(src, target=target, options=dict(num_warps=8, num_stages=2))
        asm = k.asm["amdgcn"] if arch == "gfx942" else k.asm["ptx"]
        pat = r"v_mfma_f32_\w+_fp8_fp8" if arch == "gfx942" else r"wgmma\.mma_async[\w.]*\.e4m3\.e4m3"
        out[f"{arch} {name}"] = sorted(set(re.findall(pat, asm)))
# sm_90 only: the activation quantiser (f32 -> e4m3 conversions) and the unscaled bf16 expert kernel (bf16 wgmma)
t = GPUTarget("cuda", 90, 32)
aq = dict(M=4096, K=7168, BM=32, **T._fp8_grid(jnp.float8_e4m3fn))
src = ASTSource(T._act_quant_kernel.get(False), dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32",
                                                      **{c: "constexpr" for c in aq}), aq)
ptx = compile_(src, target=t, options=dict(num_warps=4, num_stages=1)).asm["ptx"]
out["sm_90 act_quant"] = sorted(set(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)))
bf = dict(N_ROWS=4096, H=7168, I=2048, I_PAD=2048, BM=64, BN=128, BK=64, SWN=1, SWK=2048, SCALED=False,
          **T._fp8_grid(jnp.float8_e4m3fn))
sig = dict(x_ptr="*bf16", xs_ptr="*fp32", src_ptr="*i32", eid_ptr="*i32", wg_ptr="*bf16", sg_ptr="*fp32",
           wu_ptr="*bf16", su_ptr="*fp32", h_ptr="*bf16", hs_ptr="*fp32")
src = ASTSource(T._gate_up_kernel.get(False), dict(sig, **{c: "constexpr" for c in bf}), bf)
ptx = compile_(src, target=t, options=dict(num_warps=8, num_stages=3)).asm["ptx"]
out["sm_90 gate_up bf16"] = sorted(set(re.findall(r"wgmma\.mma_async[\w.]*\.bf16\.bf16", ptx)))
print(json.dumps(out))
"""


def test_kernels_compile_to_fp8_tensor_core_instructions(tmp_path):
    """Triton compiles the kernels on this machine for MI300X (gfx942, e4m3fnuz) and H100/H200 (sm_90,
    e4m3fn) without a GPU: their FP8 dots must become FP8 MFMA / wgmma instructions (AMDGCN / PTX;
    nothing is run: no AMD GPU here); for sm_90 also the activation quantiser (its FP8 grid rounding a
    helper function) to e4m3 conversions and the unscaled bf16 expert kernel to bf16 wgmma. A fresh
    process: Triton compiles only outside its interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)),
               MOEJAX_TEST_TRITON_CACHE=str(tmp_path))  # Triton's default (~/.triton) may not be writable
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(found) == 8 and all(found.values()), found


def test_rocm_selection(monkeypatch):
    """ROCm with jax-triton: FP8 (fnuz, or its uint8 bytes) expert GEMMs go W8A8 from the Triton family's
    threshold (the Triton kernel takes e4m3fnuz dots), dense projections stay W8A16; without jax-triton
    W8A16 throughout. Decisions only: Triton's interpreter has no fnuz type, and no AMD GPU is here (the
    gfx942 compile test above checks the kernels' instructions)."""
    FNUZ = jnp.float8_e4m3fnuz
    monkeypatch.setattr(common, "platform", lambda: "rocm")
    t, bf16_from = moe_fp8.MOE_FP8_THRESHOLDS["triton"]
    monkeypatch.setenv(common.W8A8_KERNEL_ENV, "triton")
    assert fp8_gemm.triton_fp8_type(jnp.uint8) == FNUZ and fp8_gemm.triton_fp8_type(FNUZ) == FNUZ
    assert fp8_gemm.triton_fp8_type(jnp.float8_e4m3fn) is None  # ROCm weights are converted to fnuz on load
    assert [moe_fp8.pick_variant("auto", 32 * r, 32, FNUZ) for r in (t - 1, t, 4096)] == ["w8a16", "w8a8", "w8a8"]
    assert moe_fp8.pick_variant("auto", 512, 1, FNUZ) == "w8a16"  # dense: no fnuz dot in Pallas-Triton
    monkeypatch.setenv(common.W8A8_KERNEL_ENV, "pallas")
    assert moe_fp8.pick_variant("auto", 32 * 4096, 32, FNUZ) == "w8a16"
