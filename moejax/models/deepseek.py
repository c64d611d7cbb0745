"""DeepSeek-V2/V3 decoder stack (pre-norm residual blocks, MLA + dense/MoE MLP)."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.layers.linear import Embedding, Linear
from moejax.layers.mla import MLA
from moejax.layers.mlp import GatedMLP
from moejax.layers.moe import ExpertParallel, MoE
from moejax.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.self_attn = MLA(c, self.layer, self.dtype)
        if c.is_moe_layer(self.layer):
            self.mlp = MoE(c, self.dtype, self.ep)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.dtype)

    def _ffn(self, h, valid):
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, valid) if self.cfg.is_moe_layer(self.layer) else self.mlp(x))

    def prefill(self, x, positions, seq_lens, cache, slots):
        a, cache = self.self_attn.prefill(self.input_layernorm(x), positions, seq_lens, cache, slots)
        return self._ffn(x + a, _real_tokens(cache, slots)), cache

    def decode(self, x, positions, cache, slots, block_tables, seq_lens, block_size):
        a, cache = self.self_attn.decode(self.input_layernorm(x), positions, cache, slots, block_tables,
                                         seq_lens, block_size)
        return self._ffn(x + a, _real_tokens(cache, slots)), cache


def _real_tokens(cache, slots):
    """Padding rows write to an out-of-range slot; those tokens are not routed to experts."""
    return None if cache is None else slots < cache.shape[1]


class DeepseekForCausalLM(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, self.dtype)
        self.layers = [DecoderLayer(c, i, self.dtype, self.ep) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, self.dtype)

    def prefill(self, tokens, positions, seq_lens, cache=None, slots=None):
        """tokens [B, S] -> final hidden states [B, S, H] (before the last norm), cache."""
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h, cache = layer.prefill(h, positions, seq_lens, cache, slots)
        return h, cache

    def decode(self, tokens, positions, cache, slots, block_tables, seq_lens, block_size: int):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h, cache = layer.decode(h, positions, cache, slots, block_tables, seq_lens, block_size)
        return h, cache

    def logits(self, h):
        return self.lm_head(self.norm(h)).astype(jnp.float32)

    def __call__(self, tokens):
        """Used only to create parameters (init)."""
        B, S = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        h, _ = self.prefill(tokens, pos, jnp.full((B,), S))
        return self.logits(h)
