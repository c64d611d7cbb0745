"""Step3's Multi-Matrix Factorization Attention (MFA).

The query is low rank: hidden -> ``share_q_dim`` (q_proj), RMSNorm (inter_norm),
then ``wq`` expands it to every head. All query heads share
``num_attention_groups`` KV heads (one in the published model) of ``head_dim``,
rotated (rotate-half / NeoX) over the whole head.

The paged cache holds, per token per layer, ``[k | v]`` of every KV head
(2 * groups * head_dim values: 512 for Step3). Prefill writes the rows at ``slots`` and
attends over the prompt itself (or, for a chunk, over the cached context) with no score
tensor (layers/prefill_attention.py); decode writes the new token's row,
gathers each sequence's rows once through its block table and computes every
query head against them in one einsum (the cache is read once per sequence,
not once per head).
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.fp8_policy import Fp8Scheme
from moejax.layers.linear import Linear
from moejax.layers.norm import RMSNorm
from moejax.layers.paged_attention import mfa_decode_attention, write_cache
from moejax.layers.prefill_attention import (check_prefill_mode, packed_prefill_attention,
                                             paged_prefill_attention, prefill_attention)
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

    def prefill(self, x, batch: ForwardBatch, cache=None):
        """x [B, S, H], batch.positions [B, S], seq_lens [B]; writes [k | v] rows to cache at batch.slots [B, S].

        A dense batch: the prompt attends to itself; a paged batch (``block_tables`` [B, nb],
        ``block_size``): the chunk is the last seq_lens[b] positions of a context of ``ctx_lens[b]``
        tokens (``positions`` must be those positions): its rows are written first, then it
        attends to positions [0, ctx_len) read from the cache one segment at a time. A packed
        batch (``cu_seqlens`` [B + 1]): the prompts are packed in one stream (x [T, H], positions and slots
        [T], seq_lens unused), each attending to itself. Every query head of a K/V group shares
        that head's keys (layers/prefill_attention.py: no [S, S] scores)."""
        c = self.cfg
        nh, G, D = c.num_attention_heads, c.num_attention_groups, c.head_dim
        check_prefill_mode(x, batch.cu_seqlens, batch.block_tables)
        q = self._query(x, batch.positions)  # [..., nh, D]
        row = self._kv_row(x, batch.positions)
        if cache is not None:
            cache = write_cache(cache, self.layer, batch.slots.reshape(-1), row.reshape(-1, row.shape[-1]))

        def per_head(rows):  # [..., 2 G D] rows [k of every head | v of every head] -> [..., G, 2D]
            lead = rows.shape[:-1]
            if G == 1:
                return rows.reshape(*lead, 1, 2 * D)
            return jnp.concatenate([rows[..., :G * D].reshape(*lead, G, D), rows[..., G * D:].reshape(*lead, G, D)], -1)

        kw = dict(scale=c.softmax_scale, v_offset=D, v_dim=D, out_dtype=x.dtype)
        if batch.mode == "packed":
            o = packed_prefill_attention(q, per_head(row), batch.cu_seqlens, **kw)
        elif batch.mode == "dense":
            o = prefill_attention(q, per_head(row), batch.seq_lens, **kw)
        else:
            if cache is None:
                raise ValueError("prefill over the paged cache needs the cache")
            o = paged_prefill_attention(q, cache, batch.block_tables, batch.seq_lens, batch.ctx_lens,
                                        batch.block_size, expand=lambda rows: (per_head(rows.astype(q.dtype)), None),
                                        row_dim=2 * G * D, layer=self.layer, **kw)
        return self.o_proj(o.reshape(*x.shape[:-1], nh * D)), cache

    def decode(self, x, batch: ForwardBatch, cache):
        """x [B, H] one new token per sequence, already counted in batch.seq_lens."""
        c = self.cfg
        q = self._query(x, batch.positions)  # [B, nh, D]
        cache = write_cache(cache, self.layer, batch.slots, self._kv_row(x, batch.positions))
        ctx = mfa_decode_attention(q, cache, batch.block_tables, batch.seq_lens, batch.block_size, c.softmax_scale,
                                   c.num_attention_groups, layer=self.layer, out_dtype=x.dtype)
        return self.o_proj(ctx.reshape(x.shape[0], -1)), cache
