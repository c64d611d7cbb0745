"""Does Pallas' Mosaic GPU backend run on this image, and how fast is JAX's own FA3-style kernel (float16 and bfloat16; 2026-12-06d's bf16 call failed on a dtype check)
(jax.experimental.pallas.ops.gpu.attention_mgpu) against the matmul rate? Decides the MLA kernel route."""
import inspect
import os
import sys
import time

import jax
import jax.numpy as jnp

print("jax", jax.__version__, jax.devices()[0].device_kind)
import jax.experimental.pallas.ops.gpu as ops  # noqa: E402
print("ops/gpu:", sorted(os.listdir(os.path.dirname(ops.__file__))))
try:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: F401
    print("plgpu names:", sorted(n for n in dir(plgpu) if not n.startswith("_")))
except Exception as e:  # noqa: BLE001
    print("mosaic_gpu import failed:", type(e).__name__, e)
    sys.exit(0)
from jax.experimental.pallas.ops.gpu import attention_mgpu as am  # noqa: E402
print("attention signature:", inspect.signature(am.attention))
print("TuningConfig:", [f for f in am.TuningConfig.__dataclass_fields__])


def t(f, *a, n=20):
    f(*a).block_until_ready()
    ts = []
    for _ in range(n):
        s = time.perf_counter(); f(*a).block_until_ready(); ts.append(time.perf_counter() - s)
    return sorted(ts)[n // 2]


for dtype in (jnp.float16, jnp.bfloat16):
    for (b, s, h, d) in [(4, 4096, 32, 128), (2, 8192, 16, 128), (8, 2048, 16, 256)]:
        k = jax.random.split(jax.random.key(0), 3)
        q, kk, v = (jax.random.normal(x, (b, s, h, d), dtype) for x in k)
        for cfg in [dict(block_q=64, block_kv=64, max_concurrent_steps=2), dict(block_q=64, block_kv=128, max_concurrent_steps=2)]:
            try:
                kw = {f: cfg[f] for f in cfg if f in am.TuningConfig.__dataclass_fields__}
                conf = am.TuningConfig(**kw)
                f = jax.jit(lambda q, k, v: am.attention(q, k, v, conf))
                dt = t(f, q, kk, v)
                print(f"attention_mgpu {dtype.__name__} b{b} s{s} h{h} d{d} {cfg}: {dt*1e3:.3f} ms {4*b*s*s*h*d/dt/1e12:.0f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                print(f"attention_mgpu {dtype.__name__} b{b} s{s} h{h} d{d} {cfg}: failed {type(e).__name__}: {str(e)[:300]}")
