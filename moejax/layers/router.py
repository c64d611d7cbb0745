"""MoE router: DeepSeek-V2 softmax (greedy / group-limited) and DeepSeek-V3
sigmoid with the aux-free correction bias and group-limited top-k (noaux_tc).

Always computed in float32: near-ties between experts are common, and a
different choice changes the output far more than any rounding.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.layers.linear import INIT_STD


def select_experts(logits, cfg, correction_bias=None):
    """logits [T, E] float32 -> (topk_idx [T, k] int32, topk_weight [T, k] float32).

    Reads cfg's n_routed_experts, num_experts_per_tok, scoring_func, topk_method, n_group,
    topk_group, norm_topk_prob, routed_scaling_factor (the DeepSeek names; other families'
    configs expose the same)."""
    E, k, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
    if cfg.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias[None, :]
    if cfg.topk_method != "greedy" and G > 1:
        grouped = choice.reshape(-1, G, E // G)
        if cfg.topk_method == "noaux_tc":
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # sum of the two best per group
        else:
            group_score = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
        # The chosen groups' mask by comparison, not a scatter (XLA:CPU expands a scatter into a while loop:
        # ~10% of a tiny MoE step's compile, BENCHMARKS.md 2026-12-07e start-up (CPU)).
        keep = (top_groups[:, :, None] == jnp.arange(G, dtype=top_groups.dtype)).any(1)
        keep = jnp.repeat(keep, E // G, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    weight = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weight * cfg.routed_scaling_factor


class Router(nn.Module):
    cfg: Any  # a family config with the router fields of select_experts

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        # HF keeps the router in float32 whatever the model dtype.
        w = self.param("weight", nn.initializers.normal(INIT_STD), (c.n_routed_experts, c.hidden_size), jnp.float32)
        bias = None
        if c.topk_method == "noaux_tc":
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (c.n_routed_experts,), jnp.float32)
        logits = jnp.einsum("ti,ei->te", x.astype(jnp.float32), w)
        return select_experts(logits, c, bias)
