"""Step3 (StepFun) text decoder stack: pre-norm residual blocks, MFA attention,
dense SiLU MLPs or a softmax top-k MoE with one shared expert.

Same interface as DeepseekForCausalLM (prefill / decode / logits / __call__), so
the runner, engine, cache and API are shared. Parameter pytree (HF names in
moejax/weights/step3_names.py):

  layers_N/self_attn/{q_proj,k_proj,v_proj,inter_norm,wq,o_proj}
  layers_N/mlp/{gate_proj,up_proj,down_proj}                 dense layers
  layers_N/mlp/gate, layers_N/mlp/experts/{gate,up,down}_proj MoE layers (router, stacked experts)
  layers_N/share_expert/{gate_proj,up_proj,down_proj}        MoE layers

The routed experts sit at ``layers_N/mlp/experts`` like DeepSeek's, so the
expert-parallel sharding rules apply unchanged.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.layers.linear import Embedding, Linear
from moejax.layers.mfa import MFA
from moejax.layers.mlp import GatedMLP
from moejax.layers.moe import ExpertParallel, RoutedExperts
from moejax.layers.norm import RMSNorm
from moejax.layers.router import Router
from moejax.models.step3_config import Step3Config


class Step3MoE(nn.Module):
    """Router (softmax over all experts, top-k, weights not renormalised unless
    norm_expert_weight) and the routed experts; the shared expert is the layer's."""
    cfg: Step3Config
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        self.gate = Router(self.cfg)
        self.experts = RoutedExperts(self.cfg, self.dtype, self.ep)

    def __call__(self, x, valid=None):
        """valid: which tokens are real (padding is neither counted in the expert statistics nor dispatched)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        if valid is None:
            return self.experts(flat, idx, w).astype(x.dtype).reshape(shape)
        return self.experts(flat, idx, w, valid.reshape(-1)).astype(x.dtype).reshape(shape)


class Step3DecoderLayer(nn.Module):
    cfg: Step3Config
    layer: int
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.self_attn = MFA(c, self.layer, self.dtype)
        if c.is_moe_layer(self.layer):
            self.mlp = Step3MoE(c, self.dtype, self.ep)
            self.share_expert = GatedMLP(c.hidden_size, c.share_expert_dim, self.dtype)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.dtype)

    def _ffn(self, h, valid):
        n = self.post_attention_layernorm(h)
        if not self.cfg.is_moe_layer(self.layer):
            return h + self.mlp(n)
        return h + self.mlp(n, valid) + self.share_expert(n)

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


class Step3ForCausalLM(nn.Module):
    cfg: Step3Config
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, self.dtype)
        self.layers = [Step3DecoderLayer(c, i, self.dtype, self.ep) for i in range(c.num_hidden_layers)]
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
