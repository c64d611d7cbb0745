"""Mosaic GPU on this card and jax: the API surface the MLA kernel uses, and jax's own FA3 example's speed."""
import functools, inspect
import jax, jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
print("jax", jax.__version__, jax.devices()[0].device_kind)
for name in ("kernel", "copy_gmem_to_smem", "wgmma", "SMEM", "Barrier", "set_max_registers", "layout_cast",
             "emit_pipeline_warp_specialized", "TilingTransform", "SwizzleTransform", "transpose_ref",
             "CompilerParams", "ACC", "barrier_arrive", "barrier_wait", "commit_smem", "copy_smem_to_gmem"):
    obj = getattr(plgpu, name, None)
    try:
        sig = str(inspect.signature(obj)) if obj is not None else "MISSING"
    except (TypeError, ValueError):
        sig = "(no signature)"
    print(f"plgpu.{name}{sig}")
print("Layout:", [m for m in dir(plgpu.Layout) if not m.startswith("_")])
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
from jax.experimental.mosaic.gpu import profiler
for hd, bkv in ((128, 128), (256, 64)):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    shape = (1, 4096, 16, hd)
    q, k, v = (jax.random.normal(kk, shape, jnp.float16) for kk in (k1, k2, k3))
    cfg = am.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=2)
    try:
        out, ms = profiler.measure(functools.partial(am.attention, config=cfg))(q, k, v)
        flops = 4 * 4096 * 4096 * hd * 16
        print(f"FA3 example hd={hd} bkv={bkv}: {ms*1e3:.1f} us = {flops/ms/1e9:.0f} TFLOP/s")
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        print(f"FA3 example hd={hd}: {type(e).__name__}: {str(e)[:400]}")
