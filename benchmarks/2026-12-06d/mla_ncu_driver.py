"""Runs one MLA decode kernel a few times at one shape, for Nsight Compute (ncu --kernel-name regex:mla).

    python3 mla_ncu_driver.py triton|pallas bf16|fp8 [B] [ctx] [heads]
"""
import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from moejax.kernels import mla_decode, paged_decode  # noqa: E402
from moejax.kernels.kv_quant import cache_row_dim, quantize_rows  # noqa: E402
from pallas_kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.triton_mla_decode import triton_mla_decode  # noqa: E402

kernel, kv = sys.argv[1], sys.argv[2]
B, ctx, H = (int(x) for x in (sys.argv[3:6] + ["512", "2048", "128"][len(sys.argv[3:6]):]))
C, R, bs = 512, 64, 16
nb = ctx // bs
k = jax.random.split(jax.random.key(0), 4)
vals = jax.random.normal(k[0], (B * nb * bs, C + R), jnp.bfloat16)
cache = (vals if kv == "bf16" else quantize_rows(vals, cache_row_dim(C + R, "fp8")))[None]
bt = jax.random.permutation(k[1], B * nb).reshape(B, nb).astype(jnp.int32)
lens = jnp.full((B,), ctx, jnp.int32)
ql = jax.random.normal(k[2], (B, H, C), jnp.bfloat16)
qr = jax.random.normal(k[3], (B, H, R), jnp.bfloat16)
if kernel == "triton":
    f = functools.partial(triton_mla_decode, **mla_decode.triton_params(B, H, ctx))
else:
    f = functools.partial(paged_decode_attention, **paged_decode.params(B, H, ctx, bs, cache.dtype))
f = jax.jit(functools.partial(f, block_size=bs, scale=0.1, layer=0, out_dtype=jnp.bfloat16))
for _ in range(5):
    out = f(ql, qr, cache, bt, lens)
out.block_until_ready()
print(kernel, kv, B, ctx, H, "ok", float(jnp.abs(out.astype(jnp.float32)).mean()))
