"""Block-FP8 dense projections: the entry point ``fp8_linear`` (Pallas ``block_scaled_matmul`` where
``select_fp8_linear`` picks it, else XLA) and the XLA reference / fallback (dequantise, then dot).

Weights stay in HF's layout [out, in] (as ``Linear``: y = x @ W.T), FP8 with 128 x 128 block scales
``scale`` [cdiv(out, 128), cdiv(in, 128)] float32 (HF's ``weight_scale_inv``: real = fp8 * scale).
``variant``: "w8a16" (bf16 activations) or "w8a8" (activations quantised per token per 128
channels, as the kernel does; the XLA path emulates that quantisation so both paths compute the
same function).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax import kernel_selection
from pallas_kernels.fp8_utils import SCALE_BLOCK, VARIANTS, act_dequant, act_quant, decode_e4m3_bits


def dequantize_fp8(w, scale, dtype=jnp.float32, weight_format: str | None = None, block: int = SCALE_BLOCK):
    """w [..., R, C] FP8 (float8_e4m3fn / float8_e4m3fnuz, or uint8 codes with ``weight_format``
    "e4m3fn_bits" | "e4m3fnuz_bits", default fnuz), scale [..., cdiv(R, block), cdiv(C, block)] -> w * scale per
    block, in ``dtype``. Layout-agnostic: HF [out, in] and moejax's stacked [E, in, out] alike."""
    R, C = w.shape[-2:]
    if jnp.dtype(w.dtype) == jnp.dtype(jnp.uint8):
        wf = decode_e4m3_bits(w, weight_format or "e4m3fnuz_bits")
    else:
        wf = w.astype(jnp.float32)
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block, axis=-2), block, axis=-1)[..., :R, :C]
    return (wf * s).astype(dtype)


def xla_compute_dtype(dtype):
    """Operand dtype of the XLA fallbacks: float32 on CPU (XLA:CPU widens bf16 dots anyway, and then
    the fallback computes the kernels' function exactly), else the activation dtype (the dequantised
    weights rounded to it: ~3e-3 relative on bf16 outputs)."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(dtype)


def fp8_linear_xla(x, w, scale, variant: str = "w8a16", out_dtype=None, weight_format: str | None = None):
    """x [..., K] @ (w [N, K] * scale)^T with f32 accumulation, in XLA: the weight dequantised
    (materialised, in ``xla_compute_dtype``), the activations quantised and dequantised per token per
    128 channels for "w8a8". Output ``out_dtype`` (default x's dtype)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    cdt = xla_compute_dtype(x.dtype)
    x2 = x.reshape(-1, K)
    x2 = act_dequant(*act_quant(x2)) if variant == "w8a8" else x2
    wd = dequantize_fp8(w, scale, cdt, weight_format)
    y = jnp.dot(x2.astype(cdt), wd.T, preferred_element_type=jnp.float32)
    return y.astype(out_dtype).reshape(*lead, w.shape[0])


def fp8_linear(x, w, scale, variant: str = "w8a16", out_dtype=None, mode: str | None = None,
               weight_format: str | None = None):
    """x [..., K] @ (w [N, K] * scale)^T through the selected kernel: Pallas ``block_scaled_matmul``
    (GPU, or forced with ``mode="pallas"``) or ``fp8_linear_xla`` (CPU default, and where the kernel
    does not apply). ``mode``: the kernel mode ("auto" | "pallas" | "xla"; None = the current
    ``kernel_mode``)."""
    lead, K = x.shape[:-1], x.shape[-1]
    variant = kernel_selection.fp8_variant(variant, x.size // K, 1, w.dtype)  # "auto": W8A16 for dense GEMMs
    y = kernel_selection.fp8_linear(x.reshape(-1, K), w, scale, variant, out_dtype, mode, weight_format)
    if y is None:
        return fp8_linear_xla(x, w, scale, variant, out_dtype, weight_format)
    return y.reshape(*lead, w.shape[0])
