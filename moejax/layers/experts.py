"""Routed experts on one device: tokens sorted by expert, grouped GEMMs.

``grouped_expert_mlp`` is the local compute shared by every dispatch backend;
the XLA path uses ``jax.lax.ragged_dot`` (static shapes: T*k rows whatever the
routing, so nothing is ever dropped). Routing to experts lives in
moejax/parallel/dispatch.py.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax import kernel_selection
from moejax.layers.fp8_experts import grouped_mlp_fp8


class ExpertWeights(NamedTuple):
    """One rank's routed-expert weights, [E_local, in, out]; FP8 weights are [E_local, out, in] (HF's
    layout) with their block scales [E_local, ceil(out/128), ceil(in/128)] and the FP8 variant
    ("w8a16" | "w8a8")."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_scale: jax.Array | None = None
    up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None
    variant: str = "w8a16"

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]


def grouped_expert_mlp(x_sorted, group_sizes, w: ExpertWeights):
    """x_sorted [N, H] rows grouped by expert -> [N, H] float32 (SiLU(x W_gate) * (x W_up)) W_down."""
    if w.gate_scale is not None:
        return grouped_mlp_fp8(x_sorted, group_sizes, w.gate, w.gate_scale, w.up, w.up_scale, w.down, w.down_scale,
                               w.variant)
    y = kernel_selection.grouped_mlp(x_sorted, group_sizes, w.gate, w.up, w.down)  # Pallas where selected (GPU)
    if y is not None:
        return y
    f32 = jnp.float32
    g = jax.lax.ragged_dot(x_sorted, w.gate, group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(x_sorted, w.up, group_sizes, preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    return jax.lax.ragged_dot(h, w.down, group_sizes, preferred_element_type=f32)
