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

import jax.numpy as jnp

from moejax.layers.linear import Embedding, Linear
from moejax.layers.mfa import MFA
from moejax.layers.mlp import GatedMLP
from moejax.layers.moe import ExpertParallel, MoE
from moejax.layers.norm import RMSNorm
from moejax.models.decoder import CausalLM, PreNormDecoderLayer
from moejax.models.step3_config import Step3Config


class Step3DecoderLayer(PreNormDecoderLayer):
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
            # Router + routed experts (softmax top-k, not renormalised); Step3's config has
            # n_shared_experts = 0 so MoE adds none: the shared expert is the layer's own.
            self.mlp = MoE(c, self.dtype, self.ep)
            self.share_expert = GatedMLP(c.hidden_size, c.share_expert_dim, self.dtype)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.dtype)

    def ffn(self, x, valid):
        if not self.cfg.is_moe_layer(self.layer):
            return self.mlp(x)
        return self.mlp(x, valid) + self.share_expert(x)


class Step3ForCausalLM(CausalLM):
    cfg: Step3Config
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, self.dtype)
        self.layers = [Step3DecoderLayer(c, i, self.dtype, self.ep) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, self.dtype)
