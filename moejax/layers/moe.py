"""DeepSeek MoE block: router, routed experts (stacked weights) and shared experts."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.layers.linear import INIT_STD
from moejax.layers.mlp import GatedMLP
from moejax.layers.router import Router
from moejax.parallel import dispatch


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How routed experts are reached: ``local`` (no mesh) or a dispatch backend over ``axis``."""
    backend: str = "local"
    axis: str | None = None
    n_ranks: int = 1


class RoutedExperts(nn.Module):
    """Expert weights stacked on a leading (physical slot) axis, laid out [E, in, out]
    for grouped GEMMs; under expert parallelism each rank holds E / ranks of them.
    ``expert_slot`` (collection "routing") maps logical expert -> physical slot, so a
    load balancer can permute experts without changing the model."""
    cfg: ModelConfig
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    @nn.compact
    def __call__(self, x, topk_idx, topk_weight):
        c = self.cfg
        E, H, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        E_here = E // self.ep.n_ranks  # under shard_map Flax sees this rank's shard
        init = nn.initializers.normal(INIT_STD)
        wg = self.param("gate_proj", init, (E_here, H, I), self.dtype)
        wu = self.param("up_proj", init, (E_here, H, I), self.dtype)
        wd = self.param("down_proj", init, (E_here, I, H), self.dtype)
        placement = self.variable("routing", "expert_slot", lambda: jnp.arange(E, dtype=jnp.int32)).value
        if self.ep.backend == "local":
            return dispatch.local_experts(x, topk_idx, topk_weight, placement, wg, wu, wd)
        fn = dispatch.dispatch_fn(self.ep.backend)
        return fn(x, topk_idx, topk_weight, placement, wg, wu, wd, self.ep.axis, self.ep.n_ranks)


class MoE(nn.Module):
    cfg: ModelConfig
    dtype: Any = jnp.float32
    ep: ExpertParallel = ExpertParallel()

    def setup(self):
        c = self.cfg
        self.gate = Router(c)
        self.experts = RoutedExperts(c, self.dtype, self.ep)
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
