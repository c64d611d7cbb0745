"""Block-FP8 dense projections: the entry point ``fp8_linear`` onto the path moejax/kernels/fp8_gemm.py
plans (the Pallas or Triton block-scaled GEMM, cuBLASLt's FP8 GEMM, or XLA's dequantise-then-dot).

Weights stay in HF's layout [out, in] (as ``Linear``: y = x @ W.T), FP8 with 128 x 128 block scales
``scale`` [cdiv(out, 128), cdiv(in, 128)] float32 (HF's ``weight_scale_inv``: real = fp8 * scale).
``variant``: "w8a16" (bf16 activations), "w8a8" (activations quantised per token per 128 channels, as
the kernel does; the XLA path emulates that quantisation so every path computes the same function) or
"auto" (from the rows).
"""

from __future__ import annotations

from moejax.kernels import fp8_gemm


def fp8_linear(x, w, scale, variant: str = "w8a16", out_dtype=None, mode: str | None = None,
               weight_format: str | None = None):
    """x [..., K] @ (w [N, K] * scale)^T -> [..., N] in ``out_dtype`` (default x's dtype). ``mode``: the
    kernel mode ("auto" | "pallas" | "xla"; None = the current ``kernel_mode``)."""
    return fp8_gemm.run(x, w, scale, variant, out_dtype, mode, weight_format)
