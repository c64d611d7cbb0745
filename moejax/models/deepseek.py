"""DeepSeek-V2/V3 decoder stack (pre-norm residual blocks, MLA + dense/MoE MLP)."""

from typing import Any

import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.layers.linear import Embedding, Linear
from moejax.layers.mla import MLA
from moejax.layers.mlp import GatedMLP
from moejax.layers.moe import ExpertParallel, MoE
from moejax.layers.norm import RMSNorm
from moejax.models.decoder import CausalLM, PreNormDecoderLayer


class DecoderLayer(PreNormDecoderLayer):
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

    def ffn(self, x, valid):
        return self.mlp(x, valid) if self.cfg.is_moe_layer(self.layer) else self.mlp(x)


class DeepseekForCausalLM(CausalLM):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, self.dtype)
        self.layers = [DecoderLayer(c, i, self.dtype, self.ep) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, self.dtype)
