"""After call J: which shapes cuBLASLt's block-scaled GEMM gets wrong (M=5, K=256, N=384 failed padded to 8)."""
import sys
import jax.numpy as jnp, numpy as np
sys.path.insert(0, "."); sys.path.insert(0, "tests")
from moejax.weights.fp8 import dequantize_block_fp8, quantize_block_fp8
from pallas_kernels.cublaslt_fp8_gemm import cublaslt_fp8_matmul
from test_fp8_kernels import hf_weight, np_act_qdq, rel_err
rng = np.random.default_rng(1)
for M, K, N in ((8, 256, 384), (5, 256, 384), (40, 256, 384), (8, 1536, 2048), (5, 1536, 2048), (256, 256, 2048),
                (256, 1536, 384), (256, 2048, 7168)):
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    q, s = quantize_block_fp8(hf_weight(rng, N, K))
    ref = np_act_qdq(np.asarray(x, np.float64)) @ dequantize_block_fp8(q, s, (128, 128)).astype(np.float64).T
    y = cublaslt_fp8_matmul(x, jnp.asarray(q), jnp.asarray(s))
    print(M, K, N, f"{rel_err(y, ref):.2e}", flush=True)
