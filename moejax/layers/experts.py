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


class SharedWeights(NamedTuple):
    """Shared experts computed with the routed ones: a shared MLP of width S*I in HF's [out, in]
    layout as the model holds it (gate / up [S*I, H], down [H, S*I]), taken as S always-selected
    experts of the routed width I (SwiGLU's intermediate columns are independent, so S experts of
    width I summed with weight 1 are that MLP). bf16 / f32 only: FP8 shared experts stay separate."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    width: int  # the routed experts' intermediate size I

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0] // self.width


def grouped_expert_mlp(x_sorted, group_sizes, w: ExpertWeights, shared: SharedWeights | None = None):
    """x_sorted [N, H] rows grouped by expert -> [N, H] float32 (SiLU(x W_gate) * (x W_up)) W_down.
    group_sizes [E] ([E + S] with ``shared``: the shared experts' groups after the routed ones)."""
    if w.gate_scale is not None:
        if shared is not None:
            raise ValueError("shared experts are fused with bf16 routed experts only, not FP8 ones")
        return grouped_mlp_fp8(x_sorted, group_sizes, w.gate, w.gate_scale, w.up, w.up_scale, w.down, w.down_scale,
                               w.variant)
    extra = () if shared is None else (shared.gate, shared.up, shared.down)
    y = kernel_selection.grouped_mlp(x_sorted, group_sizes, w.gate, w.up, w.down, extra)  # Pallas where selected
    if y is not None:
        return y
    f32 = jnp.float32
    if shared is None:
        g = jax.lax.ragged_dot(x_sorted, w.gate, group_sizes, preferred_element_type=f32)
        u = jax.lax.ragged_dot(x_sorted, w.up, group_sizes, preferred_element_type=f32)
        h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
        return jax.lax.ragged_dot(h, w.down, group_sizes, preferred_element_type=f32)
    return _xla_with_shared(x_sorted, group_sizes, w, shared)


def _xla_with_shared(x_sorted, group_sizes, w: ExpertWeights, shared: SharedWeights):
    """The XLA form of the fused layout: the routed groups through ragged_dot over the routed stack, the
    shared groups through ragged_dot over [zeros, shared experts] (the zero group spans the routed rows),
    so the same sorted rows and combine run as with the kernel. Builds the shared stack each call: a
    copy of the shared weights (the fallback path; ``shared_expert_fusion("auto")`` keeps XLA unfused)."""
    f32, E, S, I = jnp.float32, w.num_experts, shared.num_experts, shared.width
    N, H = x_sorted.shape
    gs_routed = group_sizes[:E]
    n_routed = gs_routed.sum()
    gs_shared = jnp.concatenate([n_routed[None], group_sizes[E:]])
    row = jnp.arange(N)
    is_shared = ((row >= n_routed) & (row < group_sizes.sum()))[:, None]

    def stack(a):  # [S*I, H] (HF [out, in]) -> [1 + S, H, I] ([in, out]), a zero expert first
        a = jnp.swapaxes(a.reshape(S, I, H), 1, 2)
        return jnp.concatenate([jnp.zeros_like(a[:1]), a])

    def both(x, routed, shared_stack):
        r = jax.lax.ragged_dot(x, routed, gs_routed, preferred_element_type=f32)
        s = jax.lax.ragged_dot(x, shared_stack, gs_shared, preferred_element_type=f32)
        return jnp.where(is_shared, s, r)

    g = both(x_sorted, w.gate, stack(shared.gate))
    u = both(x_sorted, w.up, stack(shared.up))
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    down = jnp.transpose(shared.down.reshape(H, S, I), (1, 2, 0))  # [H, S*I] -> [S, I, H]
    return both(h, w.down, jnp.concatenate([jnp.zeros_like(down[:1]), down]))
