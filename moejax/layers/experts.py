"""Routed experts on one device: tokens sorted by expert, grouped GEMMs.

``grouped_expert_mlp`` is the local compute shared by every dispatch backend, on the path
moejax/kernels/moe.py (bf16) or moe_fp8.py (block-FP8) plans (XLA's ``ragged_dot`` among them: static
shapes, T*k rows whatever the routing, so nothing is ever dropped). Routing to experts lives in
moejax/parallel/dispatch.py.
"""

from typing import NamedTuple

import jax

from moejax.kernels import moe, moe_fp8


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
        return moe_fp8.run(x_sorted, group_sizes, w.gate, w.gate_scale, w.up, w.up_scale, w.down, w.down_scale,
                           w.variant)
    extra = () if shared is None else (shared.gate, shared.up, shared.down)
    return moe.run(x_sorted, group_sizes, w.gate, w.up, w.down, extra)
