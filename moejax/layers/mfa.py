"""Step3's Multi-Matrix Factorization Attention (MFA).

The query is low rank: hidden -> ``share_q_dim`` (q_proj), RMSNorm (inter_norm),
then ``wq`` expands it to every head. All query heads share
``num_attention_groups`` KV heads (one in the published model) of ``head_dim``,
rotated (rotate-half / NeoX) over the whole head.

The paged cache holds, per token per layer, ``[k | v]`` of every KV head
(2 * groups * head_dim values: 512 for Step3). Prefill attends over the prompt
itself and writes the rows at ``slots``; decode writes the new token's row,
gathers each sequence's rows once through its block table and computes every
query head against them in one einsum (the cache is read once per sequence,
not once per head).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.layers.fp8_policy import Fp8Scheme
from moejax.layers.linear import Linear, einsum_f32
from moejax.layers.paged_attention import mfa_decode_attention, write_cache
from moejax.layers.norm import RMSNorm
from moejax.layers.rope import apply_rope, rope_frequencies


class MFA(nn.Module):
    cfg: Any  # Step3Config (moejax/models/step3.py)
    layer: int
    dtype: Any = jnp.float32
    fp8: Fp8Scheme | None = None  # the attention projections' FP8 scheme

    def setup(self):
        c, dt, q = self.cfg, self.dtype, self.fp8
        H, nh, G, D = c.hidden_size, c.num_attention_heads, c.num_attention_groups, c.head_dim
        self.q_proj = Linear(H, c.share_q_dim, dt, q)
        self.k_proj = Linear(H, G * D, dt, q)
        self.v_proj = Linear(H, G * D, dt, q)
        self.inter_norm = RMSNorm(c.share_q_dim, c.rms_norm_eps, dt)
        self.wq = Linear(c.share_q_dim, nh * D, dt, q)
        self.o_proj = Linear(nh * D, H, dt, q)

    def _rope(self, x, positions):
        inv_freq, attn_factor = rope_frequencies(self.cfg.rope, self.cfg.head_dim)
        return apply_rope(x, positions, inv_freq, attn_factor, interleave=False)

    def _query(self, x, positions):
        c = self.cfg
        q = self.wq(self.inter_norm(self.q_proj(x)))
        return self._rope(q.reshape(*x.shape[:-1], c.num_attention_heads, c.head_dim), positions)

    def _kv_row(self, x, positions):
        """The cache entry of each token: [rotated k of every KV head | v of every KV head]."""
        c = self.cfg
        G, D = c.num_attention_groups, c.head_dim
        k = self._rope(self.k_proj(x).reshape(*x.shape[:-1], G, D), positions)
        v = self.v_proj(x)
        return jnp.concatenate([k.reshape(*x.shape[:-1], G * D).astype(v.dtype), v], axis=-1)

    def prefill(self, x, positions, seq_lens, cache=None, slots=None):
        """x [B, S, H], positions [B, S], seq_lens [B]; writes [k | v] rows to cache at slots [B, S]."""
        c = self.cfg
        B, S, _ = x.shape
        nh, G, D = c.num_attention_heads, c.num_attention_groups, c.head_dim
        q = self._query(x, positions).reshape(B, S, G, nh // G, D)
        row = self._kv_row(x, positions)
        if cache is not None:
            cache = write_cache(cache, self.layer, slots.reshape(-1), row.reshape(B * S, -1))
        k = row[..., :G * D].reshape(B, S, G, D)
        v = row[..., G * D:].reshape(B, S, G, D)
        s = einsum_f32("bqgnd,bkgd->bgnqk", q, k) * c.softmax_scale
        qpos = jnp.arange(S)
        mask = (qpos[None, :] <= qpos[:, None])[None] & (qpos[None, None, :] < seq_lens[:, None, None])
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        o = jnp.einsum("bgnqk,bkgd->bqgnd", p, v).reshape(B, S, nh * D)
        return self.o_proj(o), cache

    def decode(self, x, positions, cache, slots, block_tables, seq_lens, block_size: int):
        """x [B, H] one new token per sequence, already counted in seq_lens."""
        c = self.cfg
        q = self._query(x, positions)  # [B, nh, D]
        cache = write_cache(cache, self.layer, slots, self._kv_row(x, positions))
        ctx = mfa_decode_attention(q, cache, block_tables, seq_lens, block_size, c.softmax_scale,
                                   c.num_attention_groups, layer=self.layer)
        return self.o_proj(ctx.astype(x.dtype).reshape(x.shape[0], -1)), cache
