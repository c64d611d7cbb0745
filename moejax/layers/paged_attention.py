"""Decode attention over the paged cache, MLA and MFA: the XLA path, and the call into the
kernel selection (moejax/kernel_selection.py) that replaces it with the Pallas kernel on GPU.

The cache is one array [layers, slots, row]; a sequence's block table maps its positions
to slots. MLA rows are [kv_lora latent | rotated rope key]: a query is first projected
into the latent space (q_nope @ W_UK), so scores and the context are computed directly
against the latents and K and V are never expanded. MFA rows are [k | v] of every KV
head, gathered once per sequence and shared by all query heads.
"""

import jax
import jax.numpy as jnp

from moejax import kernel_selection
from moejax.layers.kv_quant import as_model_dtype, dequantize_rows, encode_rows, is_fp8_cache
from moejax.layers.linear import einsum_f32


def write_cache(cache, layer: int, slots, values):
    """cache [L, num_slots, D]; slots out of range (padding) are dropped. An FP8 cache stores
    quantised rows with their scale (moejax/layers/kv_quant.py)."""
    rows = encode_rows(cache, values)
    if slots.shape[0] == 1:
        # One row would become a dynamic-update-slice, which XLA:CPU fuses with the step's reshape of
        # the cache to [1, ...] into a copy of the whole cache every step; a second (dropped) row keeps
        # it an in-place scatter.
        slots = jnp.concatenate([slots, jnp.full((1,), cache.shape[1], slots.dtype)])
        rows = jnp.concatenate([rows, rows])
    return cache.at[layer, slots].set(rows, mode="drop")


def gather_sequence_slots(block_tables, block_size: int):
    """block_tables [B, nb] -> flat cache slot of every position [B, nb*block_size]."""
    offs = jnp.arange(block_size, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * block_size + offs).reshape(block_tables.shape[0], -1)


def query_rows(x_rows: int, block_tables) -> int:
    """Query rows a sequence: 1, or Q where the step's rows come Q a sequence with one block table each
    (the speculative verify: block_tables [B, nb] for B * Q rows, a sequence's rows consecutive)."""
    B = block_tables.shape[0]
    if x_rows % B:
        raise ValueError(f"block_tables: {B} tables for {x_rows} query rows (must divide them)")
    return x_rows // B


def mla_decode_attention(q_latent, q_rope, cache_layer, block_tables, seq_lens, block_size: int, scale: float,
                         layer: int | None = None, out_dtype=None):
    """q_latent [N, H, C], q_rope [N, H, R], cache_layer [num_slots, C+R],
    block_tables [N, nb] or [N / Q, nb] (Q rows a sequence, consecutive: ``query_rows``), seq_lens [N] (>= 1)
    -> context latents [N, H, C] in ``out_dtype`` (default float32).

    With ``layer``, cache_layer is the whole cache [L, num_slots, D] (the Pallas kernel then
    reads that layer in place). An FP8 cache holds rows in the layout of layers/kv_quant.py.
    Rows a sequence go to a kernel that reads its context once for them all where one is selected;
    otherwise each row gets the sequence's table and reads the context itself."""
    N, H, C = q_latent.shape
    Q = query_rows(N, block_tables)
    if Q > 1:
        B = N // Q
        ctx = kernel_selection.mla_attention(q_latent.reshape(B, Q, H, C), q_rope.reshape(B, Q, H, -1), cache_layer,
                                             block_tables, seq_lens.reshape(B, Q), block_size, scale, layer,
                                             out_dtype=out_dtype)
        if ctx is not None:
            return ctx.reshape(N, H, C)
        block_tables = jnp.repeat(block_tables, Q, axis=0)
    ctx = kernel_selection.mla_attention(q_latent, q_rope, cache_layer, block_tables, seq_lens, block_size, scale, layer,
                                         out_dtype=out_dtype)
    if ctx is not None:
        return ctx
    if layer is not None:
        cache_layer = cache_layer[layer]
    C = q_latent.shape[-1]
    kv = cache_layer[gather_sequence_slots(block_tables, block_size)]  # [B, T, C+R]
    if is_fp8_cache(kv):
        kv = dequantize_rows(kv, C + q_rope.shape[-1]).astype(q_latent.dtype)
    kv = as_model_dtype(kv, q_latent.dtype)
    latent, k_rope = kv[..., :C], kv[..., C:]
    s = einsum_f32("bhc,btc->bht", q_latent.astype(kv.dtype), latent)
    s = s + einsum_f32("bhr,btr->bht", q_rope.astype(kv.dtype), k_rope)
    s = s * scale
    valid = jnp.arange(kv.shape[1])[None, :] < seq_lens[:, None]
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return einsum_f32("bht,btc->bhc", p.astype(kv.dtype), latent).astype(out_dtype or jnp.float32)


def mfa_decode_attention(q, cache_layer, block_tables, seq_lens, block_size: int, scale: float, num_kv_heads: int,
                         layer: int | None = None, out_dtype=None):
    """q [B, nh, D] (rotated), cache_layer [num_slots, 2*G*D] rows [k | v], block_tables [B, nb],
    seq_lens [B] (>= 1) -> context [B, nh, D] float32. With ``layer``, cache_layer is the whole
    cache [L, num_slots, D'] (the Pallas kernel then reads that layer in place).

    XLA path: one gather of the sequence's rows, then one einsum for all heads of each KV group.
    block_tables [B / Q, nb] (Q rows a sequence, ``query_rows``): each row is given its sequence's table."""
    block_tables = jnp.repeat(block_tables, query_rows(q.shape[0], block_tables), axis=0)
    ctx = kernel_selection.mfa_attention(q, cache_layer, block_tables, seq_lens, block_size, scale, num_kv_heads,
                                         layer, out_dtype=out_dtype)
    if ctx is not None:
        return ctx
    if layer is not None:
        cache_layer = cache_layer[layer]
    B, nh, D = q.shape
    G = num_kv_heads
    kv = cache_layer[gather_sequence_slots(block_tables, block_size)]  # [B, T, 2*G*D]: the only cache read
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
