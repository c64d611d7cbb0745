"""FP8 (e4m3) latent KV cache rows: quantise on write, dequantise on read.

Scale scheme: one power-of-two scale per cache row (per token per layer),
stored *inside the row*, so the cache stays one array and every write is the
same single scatter as with bf16:

    row = [ D values as float8_e4m3fn | 1 scale byte | zero padding ]
    width = round_up(D + 1, 16)            (576 -> 592 for DeepSeek-V3: +2.8%)

The scale byte holds ``e + 127`` (an unsigned exponent, like OCP MX's E8M0)
and the row's values are ``fp8 * 2**e`` with ``e = ceil(log2(amax / 448))``,
so the row's largest magnitude lands in (224, 448], the top binade of e4m3.
A power of two loses nothing against an exact amax/448 scale: e4m3 is a
floating-point format, its relative step is the same in every normal binade,
and dividing by 2**e is exact. The byte is stored with ``bitcast`` into the
float8 array (all 256 patterns are legal storage) and read back the same way,
in XLA (``dequantize_rows``) and in the Pallas kernel.

bf16 / float32 caches ("auto") keep the plain layout [D] in the model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "fp8")
_ROW_ALIGN = 16  # bytes; keeps fp8 rows 16-byte aligned for vector loads


def is_fp8_cache(cache) -> bool:
    return jnp.dtype(cache.dtype) == jnp.dtype(FP8)


def cache_row_dim(kv_dim: int, kv_cache_dtype: str = "auto") -> int:
    """Stored width of one cache row for ``kv_dim`` values (kv_lora_rank + qk_rope_head_dim)."""
    if kv_cache_dtype == "fp8":
        return -(-(kv_dim + 1) // _ROW_ALIGN) * _ROW_ALIGN
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_dim


def cache_storage_dtype(kv_cache_dtype: str, model_dtype):
    if kv_cache_dtype == "fp8":
        return jnp.dtype(FP8)
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return jnp.dtype(model_dtype)


def cache_array_dtype(kv_cache_dtype: str, model_dtype, kernels: str = "auto"):
    """The dtype the cache array is allocated in: the storage dtype, except that a bf16 cache on
    CPU under the XLA kernels is held in float32 (its values still bf16, so every result is the same).

    XLA:CPU has no native bf16 update: it normalises a bf16 scatter / dynamic-update-slice to
    float32 by converting the WHOLE cache to f32 and back, at every layer of every step, so the
    step cost grows with the cache size (0.2 s a decode step for a 144 MB cache, 3 ms for 4.5 MB).
    A float32 scatter is done in place. The Pallas kernels (interpreted on CPU) keep bf16."""
    dt = cache_storage_dtype(kv_cache_dtype, model_dtype)
    if dt == jnp.dtype(jnp.bfloat16) and kernels != "pallas" and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dt


def as_model_dtype(rows, dtype):
    """Rows read from a float32-held bf16 cache (``cache_array_dtype``), back in the model dtype."""
    return rows if is_fp8_cache(rows) or rows.dtype == jnp.dtype(dtype) else rows.astype(dtype)


def quantize_rows(values, row_dim: int):
    """values [..., D] (any float) -> stored rows [..., row_dim] float8_e4m3fn (values, scale byte, padding)."""
    D = values.shape[-1]
    assert row_dim >= D + 1, (row_dim, D)
    v = values.astype(jnp.float32)
    amax = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
    e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / FP8_MAX))
    e = jnp.clip(jnp.where(amax > 0, e, 0.0), -120.0, 120.0)
    q = jnp.clip(v * jnp.exp2(-e), -FP8_MAX, FP8_MAX).astype(FP8)
    byte = jax.lax.bitcast_convert_type((e + 127.0).astype(jnp.uint8), FP8)
    pad = jnp.zeros((*values.shape[:-1], row_dim - D - 1), FP8)
    return jnp.concatenate([q, byte, pad], axis=-1)


def row_scales(rows, kv_dim: int):
    """rows [..., row_dim] float8 -> the per-row scale 2**e, float32 [...]."""
    byte = jax.lax.bitcast_convert_type(rows[..., kv_dim], jnp.uint8)
    return jnp.exp2(byte.astype(jnp.float32) - 127.0)


def dequantize_rows(rows, kv_dim: int):
    """rows [..., row_dim] float8 -> values [..., kv_dim] float32."""
    return rows[..., :kv_dim].astype(jnp.float32) * row_scales(rows, kv_dim)[..., None]


def encode_rows(cache, values):
    """Values [..., D] in the cache's storage format (quantised rows for an fp8 cache)."""
    if is_fp8_cache(cache):
        return quantize_rows(values, cache.shape[-1])
    return values.astype(cache.dtype)


def stored_row_dim(kv_dim: int, storage_dtype) -> int:
    """Cache row width for a cache stored in ``storage_dtype`` (an FP8 cache adds its scale byte)."""
    return cache_row_dim(kv_dim, "fp8" if jnp.dtype(storage_dtype) == jnp.dtype(FP8) else "auto")
