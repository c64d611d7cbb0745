"""cuBLASLt's block-scaled FP8 GEMM (ffi/cuda, pallas_kernels/cublaslt_fp8_gemm.py): its argument checks, the
selection rule and the build script's refusal on any machine; on a CUDA GPU with the library built (pip install
or ``bash ffi/cuda/build.sh``), its products against a float64 NumPy reference with the same activation
quantisation. Seeds as in test_fp8_kernels.py (MOEJAX_TEST_SEED replays a failure)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import common, fp8_gemm, moe_fp8
from moejax.weights.fp8 import dequantize_block_fp8, quantize_block_fp8
from pallas_kernels import cublaslt_fp8_gemm as lt
from test_fp8_kernels import BF16, hf_weight, np_act_qdq, rel_err, seed_for, where

FP8 = jnp.float8_e4m3fn


def test_bad_arguments_name_the_field():
    x = jnp.ones((8, 1536), BF16)
    q, s = quantize_block_fp8(hf_weight(np.random.default_rng(0), 384, 1536))
    w, ws = jnp.asarray(q), jnp.asarray(s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        lt.cublaslt_fp8_matmul(x, w.astype(BF16), ws)
    with pytest.raises(ValueError, match="disagree on K"):
        lt.cublaslt_fp8_matmul(jnp.ones((8, 128), BF16), w, ws)
    with pytest.raises(ValueError, match="w_scale"):
        lt.cublaslt_fp8_matmul(x, w, ws[:, :1])
    with pytest.raises(ValueError, match="N % 16"):
        lt.cublaslt_fp8_matmul(x, w[:100], ws)
    with pytest.raises(ValueError, match="K % 128"):
        lt.cublaslt_fp8_matmul(x[:, :200], w[:, :200], ws[:, :2])
    if not lt.available()[0]:
        with pytest.raises(RuntimeError, match="cublaslt_fp8_matmul"):
            lt.cublaslt_fp8_matmul(x, w, ws)


def test_selection(monkeypatch):
    """CUDA: W8A8 dense projections from DENSE_W8A8_ROWS[0] rows on cuBLASLt where its library is built;
    without it the Pallas kernel within DENSE_W8A8_ROWS, above them W8A16 (XLA's dequantise-then-dot); the
    override forces a family (cuBLASLt: every row count from the range's start)."""
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    lo, hi = fp8_gemm.DENSE_W8A8_ROWS
    rows = (lo - 1, lo, hi, 8 * hi)
    monkeypatch.setattr(lt, "available", lambda: (True, ""))
    assert [fp8_gemm.dense_w8a8_kernel(r) for r in rows] == [None, "cublaslt", "cublaslt", "cublaslt"]
    assert [moe_fp8.pick_variant("auto", r, 1, FP8) for r in rows] == ["w8a16", "w8a8", "w8a8", "w8a8"]
    monkeypatch.setattr(lt, "available", lambda: (False, "not built"))
    assert [fp8_gemm.dense_w8a8_kernel(r) for r in rows] == [None, "pallas", "pallas", None]
    assert [moe_fp8.pick_variant("auto", r, 1, FP8) for r in rows] == ["w8a16", "w8a8", "w8a8", "w8a16"]
    monkeypatch.setenv(common.W8A8_DENSE_KERNEL_ENV, "cublaslt")
    assert [fp8_gemm.dense_w8a8_kernel(r) for r in rows] == [None, "cublaslt", "cublaslt", "cublaslt"]
    monkeypatch.setenv(common.W8A8_DENSE_KERNEL_ENV, "triton")
    assert [fp8_gemm.dense_w8a8_kernel(r) for r in rows] == [None, "triton", "triton", None]
    monkeypatch.setenv(common.W8A8_DENSE_KERNEL_ENV, "deepgemm")
    with pytest.raises(ValueError, match=common.W8A8_DENSE_KERNEL_ENV):
        fp8_gemm.dense_w8a8_kernel(lo)


@pytest.mark.skipif(not lt.available()[0], reason=f"cuBLASLt FP8 GEMM: {lt.available()[1]}")
@pytest.mark.parametrize("M,K,N", [(5, 1536, 384), (512, 7168, 2112), (40, 2048, 7168),
                                   # K/128 not in fours (the scales padded): K = 256 was wrong unpadded
                                   (8, 256, 384), (64, 384, 256), (16, 640, 512), (32, 512, 1024)])
def test_matches_float64_reference(M, K, N):
    seed = seed_for("cublaslt", M, K, N)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.exp(rng.uniform(-1, 1, (M, 1))), BF16)
    q, s = quantize_block_fp8(hf_weight(rng, N, K))
    ref = np_act_qdq(np.asarray(x, np.float64)) @ dequantize_block_fp8(q, s, (128, 128)).astype(np.float64).T
    y = lt.cublaslt_fp8_matmul(x, jnp.asarray(q), jnp.asarray(s))
    assert y.shape == (M, N) and y.dtype == BF16
    assert rel_err(y, ref) < 5e-3, f"rel err {rel_err(y, ref):.2e}, {where(seed)}"


def test_build_script_says_when_cublas_is_too_old(tmp_path):
    """ffi/cuda/build.sh (which pip install runs): a cuBLAS without 128x128 block scaling (before 12.9) found
    first (CUDA_HOME) is reported by path with exit 3, the code setup.py turns into a "not built" line
    rather than a failed install, and nothing is written."""
    (tmp_path / "cuda" / "include").mkdir(parents=True)
    (tmp_path / "cuda" / "include" / "cublasLt.h").write_text("/* cuBLAS 12.4: CUBLASLT_MATMUL_DESC_A_SCALE_POINTER */\n")
    script = Path(__file__).resolve().parent.parent / "ffi" / "cuda" / "build.sh"
    r = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True,
                       env=dict(os.environ, CUDA_HOME=str(tmp_path / "cuda"), PYTHON=sys.executable))
    assert r.returncode == 3 and "predates cuBLAS 12.9" in r.stderr and str(tmp_path / "cuda") in r.stderr, r
    assert not (tmp_path / "out").exists()
