"""One launch of the Mosaic GPU MLA decode kernel for Nsight Compute (ncu): 128 heads x B x 2048, bf16 or
FP8 (rows padded to fp8_row_dim), inputs made with NumPy on the host so the kernel is the program's only GPU
work besides copies. Usage: python3 mgpu_ncu.py B KV  (run under ncu with --kernel-name regex:...)."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels.kv_quant import cache_row_dim, quantize_rows
from pallas_kernels.mgpu_decode_attention import fp8_row_dim, mgpu_mla_decode

B, KV = int(sys.argv[1]), sys.argv[2]
H, C, R, bs, ctx = 128, 512, 64, 64, 2048
nb = ctx // bs
rng = np.random.default_rng(0)
slots = B * nb * bs + bs
vals = rng.standard_normal((slots, C + R), dtype=np.float32)
if KV == "bf16":
    cache = jnp.asarray(vals, jnp.bfloat16)
else:
    cache = quantize_rows(jnp.asarray(vals), cache_row_dim(C + R, "fp8"))
    cache = jnp.pad(cache, ((0, 0), (0, fp8_row_dim(C + R) - cache.shape[-1])))
ql = jnp.asarray(rng.standard_normal((B, H, C), dtype=np.float32), jnp.bfloat16)
qr = jnp.asarray(rng.standard_normal((B, H, R), dtype=np.float32), jnp.bfloat16)
bt = jnp.asarray(rng.permutation(slots // bs)[:B * nb].reshape(B, nb), jnp.int32)
lens = jnp.full((B,), ctx, jnp.int32)
f = jax.jit(lambda *a: mgpu_mla_decode(*a, block_size=bs, scale=0.04, num_splits=1, out_dtype=jnp.bfloat16))
for _ in range(3):
    out = f(ql, qr, cache, bt, lens).block_until_ready()
print("ok", out.shape, float(jnp.abs(out.astype(jnp.float32)).mean()))
