"""Routed experts on one device: tokens sorted by expert, grouped GEMMs.

``grouped_expert_mlp`` is the local compute shared by every dispatch backend;
the XLA path uses ``jax.lax.ragged_dot`` (static shapes: T*k rows whatever the
routing, so nothing is ever dropped).
"""

import jax
import jax.numpy as jnp


def grouped_expert_mlp(x_sorted, group_sizes, w_gate, w_up, w_down):
    """x_sorted [N, H] rows grouped by expert; w_gate/w_up [E, H, I], w_down [E, I, H]."""
    f32 = jnp.float32
    g = jax.lax.ragged_dot(x_sorted, w_gate, group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(x_sorted, w_up, group_sizes, preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    return jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=f32)


def sort_by_expert(topk_idx, num_experts: int):
    """Returns (order [T*k], group_sizes [E]) for the flattened assignments."""
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def routed_experts_local(x, topk_idx, topk_weight, w_gate, w_up, w_down):
    """x [T, H], topk_idx/topk_weight [T, k] -> [T, H] (float32 sum over the k experts)."""
    T, k = topk_idx.shape
    order, group_sizes = sort_by_expert(topk_idx, w_gate.shape[0])
    token_of = order // k
    y = grouped_expert_mlp(x[token_of], group_sizes, w_gate, w_up, w_down)
    y = y * topk_weight.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[token_of].add(y)
