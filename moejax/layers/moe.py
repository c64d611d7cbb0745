"""DeepSeek MoE block: router, routed experts (stacked weights) and shared experts."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.layers.experts import routed_experts_local
from moejax.layers.linear import INIT_STD
from moejax.layers.mlp import GatedMLP
from moejax.layers.router import Router


class RoutedExperts(nn.Module):
    """Expert weights stacked on a leading expert axis, laid out [E, in, out]
    for grouped GEMMs (the loader transposes HF's per-expert [out, in])."""
    cfg: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, topk_idx, topk_weight):
        c = self.cfg
        E, H, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        init = nn.initializers.normal(INIT_STD)
        wg = self.param("gate_proj", init, (E, H, I), self.dtype)
        wu = self.param("up_proj", init, (E, H, I), self.dtype)
        wd = self.param("down_proj", init, (E, I, H), self.dtype)
        return routed_experts_local(x, topk_idx, topk_weight, wg, wu, wd)


class MoE(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        self.gate = Router(c)
        self.experts = RoutedExperts(c, self.dtype)
        if c.n_shared_experts:
            self.shared_experts = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, self.dtype)

    def __call__(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        out = self.experts(flat, idx, w).astype(x.dtype).reshape(shape)
        if self.cfg.n_shared_experts:
            out = out + self.shared_experts(x)
        return out
