"""Routed experts with 128 x 128 block-FP8 weights in HF's per-expert [out, in] layout (w_gate / w_up
[E, I, H], w_down [E, H, I], scales [E, cdiv(out, 128), cdiv(in, 128)]). Paths: the Triton W8A8 fused
MoE (``fused_moe_block_fp8``), the Pallas ``fused_moe_fp8`` (W8A16 or W8A8), the weights dequantised in
the step for the bf16 experts (moe.py: "dequantised"), or XLA's dequantise-then-ragged_dot (``xla``,
which emulates W8A8's activation quantisation per token per 128 channels).

Measured: BENCHMARKS.md, "MoE and FP8 GEMM kernels" (Pallas family H100 benchmarks/2026-12-05c/h100/fp8_probe/
and benchmarks/2026-12-05d/h100/call1/fp8_tiles.txt; Triton family benchmarks/2026-12-06/h100/call2/kern.txt;
W8A16 decode tiles benchmarks/2026-12-03f/moe_layouts.txt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import common, fp8_gemm, moe
from moejax.kernels.common import W8A8_KERNEL_ENV, W8A8_KERNELS, Plan, pow2, want_kernel
from moejax.kernels.fp8_gemm import dequantize_fp8, xla_compute_dtype
from pallas_kernels import jax_triton_compat
from pallas_kernels.fp8_utils import VARIANTS, act_dequant, act_quant
from pallas_kernels.fused_moe_fp8 import fused_moe_fp8
from pallas_kernels.triton_block_fp8 import fused_moe_block_fp8

# Rows an expert from which W8A8 beats W8A16 (weight reads bound W8A16's decode; W8A8 runs FP8 dots), and
# from which the weights are dequantised in the step for the bf16 kernel instead (None: never; the
# Pallas W8A8 tiles fall behind the bf16 kernel's at prefill sizes, the Triton kernel gains on it as
# rows grow), per W8A8 kernel family (``w8a8_kernel``).
MOE_FP8_THRESHOLDS = {"pallas": (64, 1024), "triton": (16, None)}  # family: (W8A8 from, bf16 from or None)
W8A8_MIN_ROWS_PER_EXPERT, BF16_MIN_ROWS_PER_EXPERT = MOE_FP8_THRESHOLDS["pallas"]  # (the Pallas family's)
# Triton W8A8 tiles: up to 16 rows an expert one 16-row tile (the weights stream once), above 64-row tiles.
TRITON_TILES = (dict(block_m=16, block_n_down=128, num_warps=8, num_stages=3),
                dict(block_m=64, block_n_down=128, num_warps=8, num_stages=4))


def w8a8_kernel() -> str:
    """Which kernels run the W8A8 expert GEMMs on a GPU: "triton" (``fused_moe_block_fp8``, vLLM's
    block-FP8 design through jax-triton) where jax-triton is installed, else "pallas" (``fused_moe_fp8``).
    The ``w8a8_kernel`` setting (or ``MOEJAX_W8A8_KERNEL``) forces one ("triton" without jax-triton
    raises at the first call, naming the install)."""
    want = common.override("w8a8_kernel", W8A8_KERNEL_ENV, W8A8_KERNELS)
    if want != "auto":
        return want
    return "triton" if common.platform() in ("cuda", "rocm") and jax_triton_compat.available()[0] else "pallas"


def pick_variant(variant: str, rows: int, groups: int, weight_dtype) -> str:
    """The FP8 scheme of a grouped GEMM of ``rows`` rows over ``groups`` experts: as given unless "auto".
    "auto" on CUDA: W8A16 below the W8A8 family's threshold in rows an expert, W8A8 from there, "bf16"
    (dequantised, the bf16 kernel) from the family's bf16 threshold; one group: the dense GEMM's rule
    (fp8_gemm.pick_variant). ROCm: the Triton family where jax-triton is installed (fnuz dots in the
    Triton language; not run: no AMD GPU here), W8A16 elsewhere; CPU: W8A16."""
    if variant != "auto":
        return variant
    plat = common.platform()
    if plat == "rocm" and groups > 1 and fp8_gemm.triton_fp8_type(weight_dtype) is not None \
            and w8a8_kernel() == "triton":
        family = "triton"
    elif plat == "cuda" and fp8_gemm.fp8_weight_format(weight_dtype, "w8a8")[0] is not None:
        if groups <= 1:
            return fp8_gemm.pick_variant(variant, rows, weight_dtype)
        family = w8a8_kernel()
    else:
        return "w8a16"
    per_expert = rows / groups
    w8a8_from, bf16_from = MOE_FP8_THRESHOLDS[family]
    if bf16_from is not None and per_expert >= bf16_from:
        return "bf16"
    return "w8a8" if per_expert >= w8a8_from else "w8a16"


# The bf16 kernel's tiles before its 64-row decode tile (2026-12-07c): that one is not measured on the FP8 kernel.
BASE_TILES = tuple((64 if upto == 32 else upto, t) for upto, t in moe.PALLAS_TILES if upto != 64)


def pallas_plan(num_rows: int, num_experts: int, hidden: int, inter: int, dtype, weight_dtype,
                variant: str = "w8a16", mode: str | None = None) -> Plan:
    """Pallas ``fused_moe_fp8`` (params carry ``variant`` and ``weight_format``) or XLA. Tiles: the bf16
    kernel's with K steps inside one scale block; W8A8 128-wide tiles (h is requantised in the kernel's
    epilogue), 8 warps for 128-row tiles; W8A16 at decode (<= 16 rows an expert) 64-wide gate/up tiles,
    128-wide down tiles and 8 warps."""
    base = moe.pallas_plan(num_rows, num_experts, hidden, inter, dtype, mode, tiles=BASE_TILES)
    if base.path != "pallas":
        return base
    fmt, why = fp8_gemm.fp8_weight_format(weight_dtype, variant)
    if fmt is None:
        return Plan("xla", reason=why)
    p = dict(base.params, variant=variant, weight_format=fmt)
    p["block_k"], p["block_k_down"] = min(p["block_k"], 128), min(p["block_k_down"], 128)
    if variant == "w8a16" and num_rows / max(num_experts, 1) <= 16 and common.platform() != "rocm":
        p["block_n"], p["block_n_down"], p["num_warps"] = min(p["block_n"], 64), max(p["block_n_down"], 128), 8
        p["block_n_down"] = min(p["block_n_down"], pow2(hidden, 16))
    if variant == "w8a8" and inter >= 128 and hidden >= 128:
        p["block_n"], p["block_k"], p["block_n_down"], p["block_k_down"] = 128, 128, 128, 128
        p["num_warps"] = 8 if p["block_m"] >= 128 else 4
    return Plan("pallas", p, base.reason)


def triton_params(num_rows: int, num_experts: int) -> dict:
    p = dict(TRITON_TILES[0] if num_rows / max(num_experts, 1) <= 16 else TRITON_TILES[1])
    if common.platform() == "rocm":
        p["num_stages"] = 2
    return p


def plan(num_rows: int, num_experts: int, hidden: int, inter: int, dtype, weight_dtype, variant: str = "w8a16",
         mode: str | None = None, weight_format: str | None = None) -> Plan:
    """The path for scheme ``variant`` ("w8a16" | "w8a8" | "bf16"): "triton", "pallas", "dequantised" (the
    bf16 experts' plan in params["bf16"]) or "xla" (params["variant"]: the scheme it emulates)."""
    if variant == "bf16":
        bf16 = moe.plan(num_rows, num_experts, hidden, inter, dtype, mode)
        if bf16.path == "xla":  # the XLA W8A16 path dequantises the same way: the same numbers
            return Plan("xla", dict(variant="w8a16"), "bf16 scheme, no bf16 kernel: " + bf16.reason)
        return Plan("dequantised", dict(bf16=bf16), "rows an expert from the bf16 threshold")
    fp8 = fp8_gemm.triton_fp8_type(weight_dtype, weight_format) if variant == "w8a8" else None
    if fp8 is not None and want_kernel(mode)[0] and w8a8_kernel() == "triton":
        return Plan("triton", triton_params(num_rows, num_experts), "w8a8_kernel")
    p = pallas_plan(num_rows, num_experts, hidden, inter, dtype, weight_dtype, variant, mode)
    if p.path != "pallas":
        return Plan("xla", dict(variant=variant), p.reason)
    given = {"weight_format": weight_format} if weight_format else {}
    return Plan("pallas", dict(p.params, weight_layout="nk", **given), p.reason)


def run(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, variant: str = "w8a16",
        mode: str | None = None, weight_format: str | None = None):
    """x_sorted [N, H] rows grouped by expert -> [N, H] float32 (rows past sum(group_sizes): zero) on the
    planned path; ``variant`` "auto": ``pick_variant`` picks from the rows an expert."""
    N, H = x_sorted.shape
    E, I, _ = w_gate.shape
    variant = pick_variant(variant, N, E, w_gate.dtype)
    pl = plan(N, E, H, I, x_sorted.dtype, w_gate.dtype, variant, mode, weight_format)
    ws = (w_gate, s_gate, w_up, s_up, w_down, s_down)
    if pl.path == "triton":
        fp8 = fp8_gemm.triton_fp8_type(w_gate.dtype, weight_format)
        return fused_moe_block_fp8(x_sorted, group_sizes, fp8_gemm.as_triton_fp8(w_gate, fp8), s_gate,
                                   fp8_gemm.as_triton_fp8(w_up, fp8), s_up, fp8_gemm.as_triton_fp8(w_down, fp8),
                                   s_down, **pl.params)
    if pl.path == "pallas":
        return fused_moe_fp8(x_sorted, group_sizes, *ws, **pl.params)
    if pl.path == "dequantised":  # one pass over the weights, then the bf16 experts ([E, in, out])
        wg, wu, wd = (jnp.swapaxes(dequantize_fp8(w, s, x_sorted.dtype, weight_format), 1, 2)
                      for w, s in ((w_gate, s_gate), (w_up, s_up), (w_down, s_down)))
        return moe.run(x_sorted, group_sizes, wg, wu, wd, mode=mode)
    return xla(x_sorted, group_sizes, *ws, pl.params["variant"], weight_format)


def xla(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, variant: str = "w8a16",
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
