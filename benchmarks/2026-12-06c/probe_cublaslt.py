"""Which scale layouts cuBLASLt's block-scaled FP8 GEMM reads (ffi/cuda/fp8_block_gemm.cc): each of the
four (x scales [M, K/128] or its transpose; w scales HF's [N/128, K/128] or its transpose) against the XLA
W8A8 reference, at two V3 projection shapes."""
import functools, sys
import jax, jax.numpy as jnp
sys.path.insert(0, ".")
from moejax.layers.fp8_linear import fp8_linear_xla
from pallas_kernels.cublaslt_fp8_gemm import TARGET, available
from pallas_kernels.fp8_utils import act_quant
from moejax.weights.fp8 import quantize_block_fp8
import numpy as np

print("available:", available())
rng = np.random.default_rng(0)
for M, K, N in ((512, 7168, 1536), (40, 1536, 2048), (5, 256, 384)):
    wq, ws = quantize_block_fp8((rng.standard_normal((N, K)) * 0.02).astype(np.float32))
    wq, ws = jnp.asarray(wq), jnp.asarray(ws, jnp.float32)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.exp(rng.uniform(-1, 1, (M, 1))), jnp.bfloat16)
    ref = np.asarray(jax.jit(functools.partial(fp8_linear_xla, variant="w8a8"))(x, wq, ws), np.float32)
    xq, xs = act_quant(x)
    for xl in ("mk", "km"):
        for wl in ("nk", "kn"):
            a = xs if xl == "mk" else jnp.asarray(np.ascontiguousarray(np.asarray(xs).T))
            b = ws if wl == "nk" else jnp.asarray(np.ascontiguousarray(np.asarray(ws).T))
            try:
                y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), jnp.bfloat16))(xq, a.reshape(xs.shape), wq, b.reshape(ws.shape))
                y = np.asarray(y, np.float32)
                err = np.abs(y - ref).max() / np.abs(ref).max()
                print(f"M={M} K={K} N={N} x_scale {xl} w_scale {wl}: rel err {err:.3e}")
            except Exception as e:
                print(f"M={M} K={K} N={N} x_scale {xl} w_scale {wl}: {type(e).__name__}: {str(e)[:300]}")
