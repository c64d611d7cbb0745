"""Routed experts with block-FP8 weights: the entry point ``grouped_mlp_fp8`` (Pallas
``fused_moe_fp8`` where ``select_moe_fp8`` picks it, else XLA) and the XLA fallback (dequantise the
stacked weights, then ``ragged_dot`` as in experts.py).

Layout: HF's per-expert [out, in]: w_gate / w_up [E, I, H], w_down [E, H, I] FP8 (float8_e4m3fn,
float8_e4m3fnuz, or uint8 codes), scales [E, cdiv(out, 128), cdiv(in, 128)] float32 (HF's
``weight_scale_inv`` per expert, as it is). K contiguous: the FP8 fused MoE's fastest layout. ``variant``: "w8a16" | "w8a8" (the
XLA path emulates the kernel's activation quantisation: x and h per token per 128 channels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax import kernel_selection
from moejax.layers.fp8_linear import dequantize_fp8, xla_compute_dtype
from pallas_kernels.fp8_utils import VARIANTS, act_dequant, act_quant


def grouped_mlp_fp8_xla(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, variant: str = "w8a16",
                        weight_format: str | None = None):
    """[N, H] float32: the weights dequantised (materialised, in ``xla_compute_dtype``: float32 on CPU,
    x's dtype elsewhere), ragged_dot with f32 accumulation."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    dt, f32 = xla_compute_dtype(x_sorted.dtype), jnp.float32
    wg, wu, wd = (jnp.swapaxes(dequantize_fp8(w, s, dt, weight_format), 1, 2)  # -> [E, in, out]
                  for w, s in ((w_gate, s_gate), (w_up, s_up), (w_down, s_down)))
    x = (act_dequant(*act_quant(x_sorted)) if variant == "w8a8" else x_sorted).astype(dt)
    g = jax.lax.ragged_dot(x, wg, group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(x, wu, group_sizes, preferred_element_type=f32)
    h = jax.nn.silu(g) * u
    h = act_dequant(*act_quant(h)) if variant == "w8a8" else h
    return jax.lax.ragged_dot(h.astype(dt), wd, group_sizes, preferred_element_type=f32)


def grouped_mlp_dequantised(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down,
                            mode: str | None = None, weight_format: str | None = None):
    """The weights dequantised to x's dtype (and to the bf16 kernel's [E, in, out] layout), then the bf16
    Pallas kernel where selected; elsewhere the XLA W8A16 path (which dequantises the same way): the same
    numbers as W8A16."""
    wg, wu, wd = (jnp.swapaxes(dequantize_fp8(w, s, x_sorted.dtype, weight_format), 1, 2)
                  for w, s in ((w_gate, s_gate), (w_up, s_up), (w_down, s_down)))
    y = kernel_selection.grouped_mlp(x_sorted, group_sizes, wg, wu, wd, mode=mode)
    if y is None:  # (the weights above are then unused: XLA drops them)
        y = grouped_mlp_fp8_xla(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, "w8a16",
                                weight_format)
    return y


def grouped_mlp_fp8(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, variant: str = "w8a16",
                    mode: str | None = None, weight_format: str | None = None):
    """x_sorted [N, H] rows grouped by expert -> [N, H] float32 (rows past sum(group_sizes): zero from
    the kernel; the XLA path leaves ragged_dot's zeros there too) through the selected kernel.
    ``mode``: the kernel mode ("auto" | "pallas" | "xla"; None = the current ``kernel_mode``);
    ``variant`` "auto": kernel_selection.fp8_variant picks W8A8 or W8A16 from the rows an expert."""
    variant = kernel_selection.fp8_variant(variant, x_sorted.shape[0], w_gate.shape[0], w_gate.dtype)
    if variant == "bf16":  # prefill-sized groups: one pass over the weights, then the bf16 kernel
        return grouped_mlp_dequantised(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, mode,
                                       weight_format)
    y = kernel_selection.grouped_mlp_fp8(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down,
                                         variant, mode, weight_format)
    if y is None:
        return grouped_mlp_fp8_xla(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, variant,
                                   weight_format)
    return y
