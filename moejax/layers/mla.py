"""Multi-head Latent Attention (DeepSeek-V2/V3).

Prefill uses the expanded form (K/V rebuilt from the latents of the prompt
itself, or of the cached context for a chunk, one causal flash attention with no score
tensor: layers/prefill_attention.py). Decode uses the absorbed form against the
paged latent cache: per token per layer only kv_lora_rank + qk_rope_head_dim
values are stored and read.

q_a_proj and kv_a_proj_with_mqa read the same normed input, so where both exist they are one
GEMM, ``qkv_a_proj`` [q_lora_rank + kv_lora_rank + qk_rope_head_dim, H], its output split. The
checkpoint keeps HF's two tensors: the loader concatenates them along ``out`` (the family's
``fused_parts``, moejax/models/deepseek.py) and the HF writer splits them again.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.kernels.common import einsum_f32
from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.fp8_policy import Fp8Scheme
from moejax.layers.linear import Linear
from moejax.layers.norm import RMSNorm
from moejax.layers.paged_attention import mla_decode_attention, write_cache
from moejax.layers.prefill_attention import (check_prefill_mode, packed_prefill_attention,
                                             paged_prefill_attention, prefill_attention)
from moejax.layers.rope import apply_rope, rope_frequencies


def merges_q_kv_a(cfg, fp8: Fp8Scheme | None) -> bool:
    """Whether q_a_proj and kv_a_proj_with_mqa are one ``qkv_a_proj``: only with a q_lora_rank, and under
    FP8 only where q_lora_rank is a multiple of the block rows (the two block-scale grids then stack
    along ``out``; DeepSeek-V3's 1536 is 12 x 128)."""
    return cfg.q_lora_rank is not None and (fp8 is None or cfg.q_lora_rank % fp8.block[0] == 0)


class MLA(nn.Module):
    cfg: Any  # DeepseekConfig (moejax/models/deepseek.py)
    layer: int
    dtype: Any = jnp.float32
    fp8: Fp8Scheme | None = None  # the attention projections' FP8 scheme
    merge_q_kv_a: bool = True  # False keeps the two projections apart (the reference in tests)
    cache_layer: Any = None  # the cache layer written and read, where not ``layer`` (a scanned layer's traced index)

    @property
    def cache_index(self):
        return self.layer if self.cache_layer is None else self.cache_layer

    def setup(self):
        c, dt, q = self.cfg, self.dtype, self.fp8
        H, nh = c.hidden_size, c.num_attention_heads
        self.merged = self.merge_q_kv_a and merges_q_kv_a(c, q)
        if self.merged:
            self.qkv_a_proj = Linear(H, c.q_lora_rank + c.kv_cache_dim, dt, q)
        elif c.q_lora_rank is not None:
            self.q_a_proj = Linear(H, c.q_lora_rank, dt, q)
        if c.q_lora_rank is None:
            self.q_proj = Linear(H, nh * c.qk_head_dim, dt, q)
        else:
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dt)
            self.q_b_proj = Linear(c.q_lora_rank, nh * c.qk_head_dim, dt, q)
        if not self.merged:
            self.kv_a_proj_with_mqa = Linear(H, c.kv_cache_dim, dt, q)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dt)
        self.kv_b_proj = Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), dt)
        self.o_proj = Linear(nh * c.v_head_dim, H, dt, q)

    def _rope(self, x, positions):
        inv_freq, attn_factor = rope_frequencies(self.cfg.rope, self.cfg.qk_rope_head_dim)
        return apply_rope(x, positions, inv_freq, attn_factor, self.cfg.rope.interleave)

    def _project_a(self, x):
        """(q_a [..., q_lora_rank] or None without q_lora, kv_a [..., kv_lora_rank + rope])."""
        c = self.cfg
        if self.merged:
            y = self.qkv_a_proj(x)
            return y[..., :c.q_lora_rank], y[..., c.q_lora_rank:]
        q_a = None if c.q_lora_rank is None else self.q_a_proj(x)
        return q_a, self.kv_a_proj_with_mqa(x)

    def _query(self, x, q_a, positions):
        c = self.cfg
        q = self.q_proj(x) if q_a is None else self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.reshape(*x.shape[:-1], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        return q_nope, self._rope(q_rope, positions)

    def _latent(self, kv, positions):
        """The cache entry of each token from its kv_a output: [normalised latent | rotated rope key]."""
        c = self.cfg
        latent = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        k_rope = self._rope(kv[..., c.kv_lora_rank:], positions)
        return jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)

    def prefill(self, x, batch: ForwardBatch, cache=None):
        """x [B, S, H], batch.positions [B, S], seq_lens [B]; writes latents to cache at batch.slots [B, S].

        A dense batch: the prompt attends to itself (expanded K/V of its own latents;
        query i at position i). A paged batch (``block_tables`` [B, nb], ``block_size``): the chunk is
        the last seq_lens[b] positions of a context of ``ctx_lens[b]`` tokens (default seq_lens;
        ``positions`` must be those positions): its latents are written first, then it attends
        to positions [0, ctx_len) read from the cache, expanded through kv_b_proj one segment at
        a time (layers/prefill_attention.py; the expanded form beats the absorbed one from about
        170 query tokens a chunk, docs/architecture.md). A packed batch (``cu_seqlens`` [B + 1]): the prompts
        are packed in one stream: x [T, H], positions and slots [T], seq_lens unused, and each
        prompt attends to itself (``packed_prefill_attention``). Every path is memory-bounded:
        no [S, S] scores (layers/prefill_attention.py)."""
        c = self.cfg
        nh, dn, dv, C = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        check_prefill_mode(x, batch.cu_seqlens, batch.block_tables)
        q_a, kv_a = self._project_a(x)
        q_nope, q_rope = self._query(x, q_a, batch.positions)  # [..., nh, dn], [..., nh, R]
        lat = self._latent(kv_a, batch.positions)
        if cache is not None:
            cache = write_cache(cache, self.cache_index, batch.slots.reshape(-1), lat.reshape(-1, lat.shape[-1]))
        kw = dict(scale=c.softmax_scale, v_offset=dn, v_dim=dv, out_dtype=x.dtype)
        if batch.mode != "paged":
            kv = self.kv_b_proj(lat[..., :C]).reshape(*lat.shape[:-1], nh, dn + dv)  # [k_nope | v] per head
            if batch.mode == "dense":
                o = prefill_attention(q_nope, kv, batch.seq_lens, q_rope=q_rope, k_rope=lat[..., C:], **kw)
            else:
                o = packed_prefill_attention(q_nope, kv, batch.cu_seqlens, q_rope=q_rope, k_rope=lat[..., C:], **kw)
        else:
            if cache is None:
                raise ValueError("prefill over the paged cache needs the cache")
            w_kv_b = self.kv_b_proj.weight  # [nh * (dn + dv), C]

            def expand(rows):  # cache rows [B, T, C + R] -> [k_nope | v] per head, shared rope key
                kv = jnp.einsum("...i,oi->...o", rows[..., :C].astype(w_kv_b.dtype), w_kv_b)
                return kv.reshape(*rows.shape[:2], nh, dn + dv), rows[..., C:]

            o = paged_prefill_attention(q_nope, cache, batch.block_tables, batch.seq_lens, batch.ctx_lens,
                                        batch.block_size, expand=expand,
                                        row_dim=C + c.qk_rope_head_dim, q_rope=q_rope, layer=self.cache_index, **kw)
        return self.o_proj(o.reshape(*x.shape[:-1], nh * dv)), cache

    def decode(self, x, batch: ForwardBatch, cache):
        """x [B, H] one new token per sequence, already counted in batch.seq_lens."""
        c = self.cfg
        nh, dn, C = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        q_a, kv_a = self._project_a(x)
        q_nope, q_rope = self._query(x, q_a, batch.positions)  # [B, nh, dn], [B, nh, R]
        cache = write_cache(cache, self.cache_index, batch.slots, self._latent(kv_a, batch.positions))
        w_kv_b = self.kv_b_proj.weight.reshape(nh, dn + c.v_head_dim, C)
        w_uk, w_uv = w_kv_b[:, :dn], w_kv_b[:, dn:]
        q_latent = einsum_f32("bhn,hnc->bhc", q_nope, w_uk)
        ctx = mla_decode_attention(q_latent.astype(x.dtype), q_rope, cache, batch.block_tables, batch.seq_lens,
                                   batch.block_size, c.softmax_scale, layer=self.cache_index, out_dtype=x.dtype)
        o = jnp.einsum("bhc,hvc->bhv", ctx, w_uv)
        return self.o_proj(o.reshape(x.shape[0], -1)), cache
