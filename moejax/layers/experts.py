"""Routed experts on one device: tokens sorted by expert, grouped GEMMs.

``grouped_expert_mlp`` is the local compute shared by every dispatch backend;
the XLA path uses ``jax.lax.ragged_dot`` (static shapes: T*k rows whatever the
routing, so nothing is ever dropped). Routing to experts lives in
moejax/parallel/dispatch.py.
"""

import jax
import jax.numpy as jnp

from moejax import kernel_selection


def grouped_expert_mlp(x_sorted, group_sizes, w_gate, w_up, w_down):
    """x_sorted [N, H] rows grouped by expert; w_gate/w_up [E, H, I], w_down [E, I, H]."""
    y = kernel_selection.grouped_mlp(x_sorted, group_sizes, w_gate, w_up, w_down)
    if y is not None:
        return y
    f32 = jnp.float32
    g = jax.lax.ragged_dot(x_sorted, w_gate, group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(x_sorted, w_up, group_sizes, preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    return jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=f32)

