"""Step3 MFA decode (all query heads against one K/V head) over the paged [k | v] cache: the MLA kernel
``paged_decode_attention`` with no rope part and values at column ``head_dim``, tiled as MLA is
(paged_decode.params), or XLA's gather path (``xla``; grouped K/V heads always). ``plan`` decides once
from the shapes, the cache dtype and the platform; ``run`` computes its path.

The Mosaic GPU kernel (pallas_kernels/mgpu_decode_attention.mgpu_mfa_decode: the MLA kernel's design on MFA's
row) runs where ``mfa_kernel=mgpu`` forces it and the shapes fit (Hopper, bf16 cache, 64-head multiples);
not the default until measured on a GPU (benchmarks/2026-12-07g/gpu1.sh: not yet run).

Measured: BENCHMARKS.md, "MLA and MFA decode kernels" (H200, Step3's 64 heads x 256, context 4096: the
gather tile with 32-head blocks 1.77x XLA at batch 256, benchmarks/2026-12-03b/kernels_mfa_gather_sweep.txt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import common, paged_decode
from moejax.kernels.common import MFA_KERNEL_ENV, MFA_KERNELS, Plan, einsum_f32, plan_reason, triton_dim, want_kernel
from moejax.kernels.kv_quant import as_model_dtype, dequantize_rows, is_fp8_cache
from moejax.kernels.mla_decode import mgpu_params
from pallas_kernels import mgpu_decode_attention as mgpu
from pallas_kernels.paged_decode_attention import paged_decode_attention


def mfa_kernel() -> str:
    """Which kernel runs MFA decode on a GPU: "pallas" (the gather tile; the Mosaic GPU kernel is not the
    default until measured), or what the ``mfa_kernel`` setting (``MOEJAX_MFA_KERNEL``) forces: pallas or
    mgpu (where ``mgpu_fits``)."""
    want = common.override("mfa_kernel", MFA_KERNEL_ENV, MFA_KERNELS)
    return "pallas" if want == "auto" else want


def mgpu_fits(heads: int, head_dim: int, block_size: int, cache_dtype) -> bool:
    """The Mosaic GPU kernel's shapes (mgpu_decode_attention.check_shapes; MFA over bf16 only), where jax has it."""
    if jnp.dtype(cache_dtype) != jnp.dtype(jnp.bfloat16) or not mgpu.available()[0]:
        return False
    try:
        mgpu.check_shapes(heads, head_dim, 0, 64, block_size, cache_dtype, jnp.bfloat16)
    except ValueError:
        return False
    return True


def plan(batch: int, heads: int, head_dim: int, groups: int, max_len: int, block_size: int, cache_dtype,
         mode: str | None = None) -> Plan:
    """"mgpu" (forced by ``mfa_kernel``, where it fits) or "pallas" with its tiling, or "xla"."""
    use, forced = want_kernel(mode)
    if not use:
        return Plan("xla", reason="mode or platform")
    if groups != 1:
        return Plan("xla", reason="the kernel reads one K/V head per row; grouped K/V heads use XLA")
    if mfa_kernel() == "mgpu" and mgpu_fits(heads, head_dim, block_size, cache_dtype):
        return Plan("mgpu", mgpu_params(batch, heads, max_len), plan_reason(forced))
    if not forced and not triton_dim(head_dim):
        return Plan("xla", reason="head_dim not a power of two >= 16 (Triton blocks)")
    if not forced and paged_decode.slow_fp8(heads, cache_dtype):
        return Plan("xla", reason=paged_decode.slow_fp8.__doc__)
    return Plan("pallas", paged_decode.params(batch, heads, max_len, block_size, cache_dtype), plan_reason(forced))


def run(q, cache, block_tables, seq_lens, block_size: int, scale: float, num_kv_heads: int,
        layer: int | None = None, mode: str | None = None, out_dtype=None):
    """q [B, nh, D] (rotated), cache [num_slots, 2*G*D] rows [k | v] (or [L, num_slots, D'] with ``layer``),
    block_tables [B, nb], seq_lens [B] (>= 1) -> context [B, nh, D] in ``out_dtype`` (default float32)."""
    B, H, D = q.shape
    pl = plan(B, H, D, num_kv_heads, block_tables.shape[1] * block_size, block_size, cache.dtype, mode)
    if pl.path == "mgpu":
        return mgpu.mgpu_mfa_decode(q, cache, block_tables, seq_lens, block_size=block_size, scale=float(scale),
                                    layer=layer, out_dtype=out_dtype, **pl.params)
    if pl.path == "pallas":
        return paged_decode_attention(q, None, cache, block_tables, seq_lens, block_size=block_size,
                                      scale=float(scale), layer=layer, v_offset=D, out_dtype=out_dtype, **pl.params)
    return xla(q, cache, block_tables, seq_lens, block_size, scale, num_kv_heads, layer, out_dtype)


def xla(q, cache, block_tables, seq_lens, block_size: int, scale: float, num_kv_heads: int,
        layer: int | None = None, out_dtype=None):
    """One gather of the sequence's rows, then one einsum for all heads of each KV group."""
    if layer is not None:
        cache = cache[layer]
    B, nh, D = q.shape
    G = num_kv_heads
    kv = cache[paged_decode.gather_sequence_slots(block_tables, block_size)]  # [B, T, 2*G*D]: the only cache read
    if is_fp8_cache(kv):
        kv = dequantize_rows(kv, 2 * G * D).astype(q.dtype)
    kv = as_model_dtype(kv, q.dtype)
    T = kv.shape[1]
    k = kv[..., :G * D].reshape(B, T, G, D)
    v = kv[..., G * D:].reshape(B, T, G, D)
    qg = q.reshape(B, G, nh // G, D).astype(kv.dtype)
    s = einsum_f32("bgnd,btgd->bgnt", qg, k) * scale
    valid = jnp.arange(T)[None, :] < seq_lens[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    ctx = einsum_f32("bgnt,btgd->bgnd", p.astype(kv.dtype), v)
    return ctx.reshape(B, nh, D).astype(out_dtype or jnp.float32)
