"""Multi-head Latent Attention (DeepSeek-V2/V3).

Prefill uses the expanded form (K/V rebuilt from the latents of the prompt
itself, one causal attention). Decode uses the absorbed form against the
paged latent cache: per token per layer only kv_lora_rank + qk_rope_head_dim
values are stored and read.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.layers.fp8_policy import Fp8Scheme
from moejax.layers.linear import Linear, einsum_f32
from moejax.layers.paged_attention import mla_decode_attention, write_cache
from moejax.layers.norm import RMSNorm
from moejax.layers.rope import apply_rope, rope_frequencies


class MLA(nn.Module):
    cfg: Any  # DeepseekConfig (moejax/models/deepseek.py)
    layer: int
    dtype: Any = jnp.float32
    fp8: Fp8Scheme | None = None  # the attention projections' FP8 scheme

    def setup(self):
        c, dt, q = self.cfg, self.dtype, self.fp8
        H, nh = c.hidden_size, c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = Linear(H, nh * c.qk_head_dim, dt, q)
        else:
            self.q_a_proj = Linear(H, c.q_lora_rank, dt, q)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dt)
            self.q_b_proj = Linear(c.q_lora_rank, nh * c.qk_head_dim, dt, q)
        self.kv_a_proj_with_mqa = Linear(H, c.kv_lora_rank + c.qk_rope_head_dim, dt, q)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dt)
        self.kv_b_proj = Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), dt)
        self.o_proj = Linear(nh * c.v_head_dim, H, dt, q)

    def _rope(self, x, positions):
        inv_freq, attn_factor = rope_frequencies(self.cfg.rope, self.cfg.qk_rope_head_dim)
        return apply_rope(x, positions, inv_freq, attn_factor, self.cfg.rope.interleave)

    def _query(self, x, positions):
        c = self.cfg
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:-1], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        return q_nope, self._rope(q_rope, positions)

    def _latent(self, x, positions):
        """The cache entry of each token: [normalised latent | rotated rope key]."""
        c = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        k_rope = self._rope(kv[..., c.kv_lora_rank:], positions)
        return jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)

    def prefill(self, x, positions, seq_lens, cache=None, slots=None):
        """x [B, S, H], positions [B, S], seq_lens [B]; writes latents to cache at slots [B, S]."""
        c = self.cfg
        B, S, _ = x.shape
        nh, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        q_nope, q_rope = self._query(x, positions)
        lat = self._latent(x, positions)
        if cache is not None:
            cache = write_cache(cache, self.layer, slots.reshape(-1), lat.reshape(B * S, -1))
        latent, k_rope = lat[..., :c.kv_lora_rank], lat[..., c.kv_lora_rank:]
        kv = self.kv_b_proj(latent).reshape(B, S, nh, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        s = einsum_f32("bqhd,bkhd->bhqk", q_nope, k_nope)
        s = s + einsum_f32("bqhr,bkr->bhqk", q_rope, k_rope)
        s = s * c.softmax_scale
        qpos = jnp.arange(S)
        mask = (qpos[None, :] <= qpos[:, None])[None] & (qpos[None, None, :] < seq_lens[:, None, None])
        s = jnp.where(mask[:, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, S, nh * dv)
        return self.o_proj(o), cache

    def decode(self, x, positions, cache, slots, block_tables, seq_lens, block_size: int):
        """x [B, H] one new token per sequence, already counted in seq_lens."""
        c = self.cfg
        nh, dn, C = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        q_nope, q_rope = self._query(x, positions)  # [B, nh, dn], [B, nh, R]
        cache = write_cache(cache, self.layer, slots, self._latent(x, positions))
        w_kv_b = self.kv_b_proj.weight.reshape(nh, dn + c.v_head_dim, C)
        w_uk, w_uv = w_kv_b[:, :dn], w_kv_b[:, dn:]
        q_latent = einsum_f32("bhn,hnc->bhc", q_nope, w_uk)
        ctx = mla_decode_attention(q_latent.astype(x.dtype), q_rope, cache, block_tables,
                                   seq_lens, block_size, c.softmax_scale, layer=self.layer)
        o = jnp.einsum("bhc,hvc->bhv", ctx.astype(x.dtype), w_uv)
        return self.o_proj(o.reshape(x.shape[0], -1)), cache
