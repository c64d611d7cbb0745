"""Absorbed MLA decode attention over the paged latent cache (XLA reference path).

Each token's cache entry is [kv_lora latent | rotated rope key]. A query is
first projected into the latent space (q_nope @ W_UK), so scores and the
context are computed directly against the latents; K and V are never expanded.
This is the op the Pallas kernel replaces on GPU.
"""

import jax
import jax.numpy as jnp

from moejax.layers.linear import einsum_f32
from moejax.layers.kv_quant import dequantize_rows, is_fp8_cache


def gather_sequence_slots(block_tables, block_size: int):
    """block_tables [B, nb] -> flat cache slot of every position [B, nb*block_size]."""
    offs = jnp.arange(block_size, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * block_size + offs).reshape(block_tables.shape[0], -1)


def mla_decode_attention(q_latent, q_rope, cache_layer, block_tables, seq_lens, block_size: int, scale: float,
                         layer: int | None = None):
    """q_latent [B, H, C], q_rope [B, H, R], cache_layer [num_slots, C+R],
    block_tables [B, nb], seq_lens [B] (>= 1) -> context latents [B, H, C] float32.

    With ``layer``, cache_layer is the whole cache [L, num_slots, D] (the Pallas kernel then
    reads that layer in place). An FP8 cache holds rows in the layout of layers/kv_quant.py."""
    from moejax.kernels.selection import mla_attention  # Pallas kernel where selected (GPU)
    ctx = mla_attention(q_latent, q_rope, cache_layer, block_tables, seq_lens, block_size, scale, layer)
    if ctx is not None:
        return ctx
    if layer is not None:
        cache_layer = cache_layer[layer]
    C = q_latent.shape[-1]
    kv = cache_layer[gather_sequence_slots(block_tables, block_size)]  # [B, T, C+R]
    if is_fp8_cache(kv):
        kv = dequantize_rows(kv, C + q_rope.shape[-1]).astype(q_latent.dtype)
    latent, k_rope = kv[..., :C], kv[..., C:]
    s = einsum_f32("bhc,btc->bht", q_latent.astype(kv.dtype), latent)
    s = s + einsum_f32("bhr,btr->bht", q_rope.astype(kv.dtype), k_rope)
    s = s * scale
    valid = jnp.arange(kv.shape[1])[None, :] < seq_lens[:, None]
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return einsum_f32("bht,btc->bhc", p.astype(kv.dtype), latent)
