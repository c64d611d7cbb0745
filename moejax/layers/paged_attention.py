"""Decode attention over the paged cache, MLA and MFA: the cache write, and the layers' entry points onto
the paths moejax/kernels/mla_decode.py and mfa_decode.py plan (the Triton or Pallas kernel, or XLA).

The cache is one array [layers, slots, row]; a sequence's block table maps its positions
to slots. MLA rows are [kv_lora latent | rotated rope key]: a query is first projected
into the latent space (q_nope @ W_UK), so scores and the context are computed directly
against the latents and K and V are never expanded. MFA rows are [k | v] of every KV
head, gathered once per sequence and shared by all query heads.
"""

import jax.numpy as jnp

from moejax.kernels import mfa_decode, mla_decode
from moejax.kernels.kv_quant import encode_rows


def write_cache(cache, layer: int, slots, values):
    """cache [L, num_slots, D]; slots out of range (padding) are dropped. An FP8 cache stores
    quantised rows with their scale (moejax/kernels/kv_quant.py)."""
    rows = encode_rows(cache, values)
    if slots.shape[0] == 1:
        # One row would become a dynamic-update-slice, which XLA:CPU fuses with the step's reshape of
        # the cache to [1, ...] into a copy of the whole cache every step; a second (dropped) row keeps
        # it an in-place scatter.
        slots = jnp.concatenate([slots, jnp.full((1,), cache.shape[1], slots.dtype)])
        rows = jnp.concatenate([rows, rows])
    return cache.at[layer, slots].set(rows, mode="drop")


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
    reads that layer in place). An FP8 cache holds rows in the layout of kernels/kv_quant.py.
    Rows a sequence go to a kernel that reads its context once for them all where one is selected;
    otherwise each row gets the sequence's table and reads the context itself."""
    return mla_decode.run(q_latent, q_rope, cache_layer, block_tables, seq_lens, block_size, scale, layer,
                          out_dtype=out_dtype, rows=query_rows(q_latent.shape[0], block_tables))


def mfa_decode_attention(q, cache_layer, block_tables, seq_lens, block_size: int, scale: float, num_kv_heads: int,
                         layer: int | None = None, out_dtype=None):
    """q [B, nh, D] (rotated), cache_layer [num_slots, 2*G*D] rows [k | v], block_tables [B, nb],
    seq_lens [B] (>= 1) -> context [B, nh, D] float32. With ``layer``, cache_layer is the whole
    cache [L, num_slots, D'] (the Pallas kernel then reads that layer in place).

    block_tables [B / Q, nb] (Q rows a sequence, ``query_rows``): each row is given its sequence's table."""
    block_tables = jnp.repeat(block_tables, query_rows(q.shape[0], block_tables), axis=0)
    return mfa_decode.run(q, cache_layer, block_tables, seq_lens, block_size, scale, num_kv_heads, layer,
                          out_dtype=out_dtype)
