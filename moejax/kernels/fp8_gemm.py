"""Dense block-FP8 GEMM: y = x[..., K] @ (W[N, K] * scale)^T with 128 x 128 block scales (HF's layout and
``weight_scale_inv``). Paths: the Pallas ``block_scaled_matmul`` (W8A16 or W8A8), the Triton W8A8 GEMM,
cuBLASLt's block-scaled FP8 GEMM, or XLA's dequantise-then-dot (``xla``, which emulates W8A8's
activation quantisation so every path computes the same function). Also the FP8 weight formats and the
scheme a GEMM runs (``pick_variant``), which the FP8 experts (moe_fp8.py) share.

Measured: BENCHMARKS.md, "MoE and FP8 GEMM kernels" (H100 tiles benchmarks/2026-12-05d/h100/call1/fp8_tiles.txt;
W8A8 rows benchmarks/2026-12-05d/h200/w8a8dense.txt; above 64 rows benchmarks/2026-12-03d/kernels_fp8.txt;
cuBLASLt benchmarks/2026-12-06c/h100/rI/gemm.txt; Triton benchmarks/2026-12-06/h100/call2/kern.txt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import common
from moejax.kernels.common import W8A8_DENSE_KERNEL_ENV, W8A8_DENSE_KERNELS, Plan, plan_reason, pow2, want_kernel
from pallas_kernels import cublaslt_fp8_gemm, jax_triton_compat
from pallas_kernels.block_scaled_matmul import block_scaled_matmul
from pallas_kernels.fp8_utils import SCALE_BLOCK, VARIANTS, act_dequant, act_quant, decode_e4m3_bits
from pallas_kernels.triton_block_fp8 import act_quant_triton, block_fp8_matmul

# The thresholds (rows M of the GEMM):
# - W8A8 from DENSE_W8A8_ROWS[0] rows: cuBLASLt's FP8 GEMM where its library is built on CUDA (5-6% faster
#   than the Pallas kernel in the 512 x 2048 FP8 step, no stall since its FFI target is command-buffer
#   compatible: BENCHMARKS.md 2026-12-07); without it the Pallas kernel up to DENSE_W8A8_ROWS[1] (XLA's
#   weight pass, fp8 read and bf16 written and read again, costs more there) and XLA above (amortised).
# - W8A16 on the Pallas kernel up to W8A16_MAX_ROWS on CUDA (XLA's dequantise-then-dot beat it above);
#   ROCm keeps the kernel (not measured).
DENSE_W8A8_ROWS = (256, 2048)
W8A16_MAX_ROWS = 64


def fp8_weight_format(weight_dtype, variant: str) -> tuple[str | None, str]:
    """How the FP8 kernels read these weights here (fp8_utils.WEIGHT_FORMATS), or (None, why not)."""
    dt = jnp.dtype(weight_dtype)
    fn, fnuz = dt == jnp.dtype(jnp.float8_e4m3fn), dt in (jnp.dtype(jnp.float8_e4m3fnuz), jnp.dtype(jnp.uint8))
    if not (fn or fnuz):
        return None, f"weight dtype {dt}"
    if common.platform() == "rocm" or fnuz:  # no FP8 type through Pallas-Triton there: integer decode, W8A16
        if variant == "w8a8":
            return None, "w8a8 needs e4m3fn dots (Pallas-Triton has no fnuz casts)"
        return ("e4m3fnuz_bits" if fnuz else "e4m3fn_bits"), ""
    try:
        cc = float(getattr(jax.devices()[0], "compute_capability", "9.0"))
    except Exception:  # pragma: no cover
        cc = 9.0
    if cc >= 8.9 or common.platform() == "cpu":
        return "e4m3fn", ""
    return (None, "w8a8 needs compute capability 8.9+") if variant == "w8a8" else ("e4m3fn_bits", "")


def triton_fp8_type(weight_dtype, weight_format: str | None = None):
    """The FP8 type the Triton W8A8 kernels read these weights as here, or None: e4m3fn on CUDA with FP8
    dots (compute capability 8.9+), e4m3fnuz on ROCm (fnuz weights, or their uint8 bytes)."""
    dt, plat = jnp.dtype(weight_dtype), common.platform()
    if plat == "cuda" and dt == jnp.dtype(jnp.float8_e4m3fn) and weight_format in (None, "e4m3fn"):
        return jnp.float8_e4m3fn if fp8_weight_format(dt, "w8a8")[0] == "e4m3fn" else None
    if plat == "rocm" and weight_format in (None, "e4m3fnuz_bits") and \
            dt in (jnp.dtype(jnp.float8_e4m3fnuz), jnp.dtype(jnp.uint8)):
        return jnp.float8_e4m3fnuz
    return None


def as_triton_fp8(w, fp8):
    """uint8 weights (the bytes of fnuz weights, ROCm) as ``fp8``; others as they are."""
    return jax.lax.bitcast_convert_type(w, fp8) if jnp.dtype(w.dtype) == jnp.dtype(jnp.uint8) else w


def dense_w8a8_kernel(rows: int) -> str | None:
    """Which kernel runs a W8A8 dense projection of ``rows`` rows on CUDA, or None (W8A16): from
    DENSE_W8A8_ROWS[0] rows cuBLASLt's where its library is built, else the Pallas kernel up to
    DENSE_W8A8_ROWS[1]. The ``w8a8_dense_kernel`` setting (or ``MOEJAX_W8A8_DENSE_KERNEL``) forces a family
    from DENSE_W8A8_ROWS[0]: "pallas" / "triton" within the range, "cublaslt" with no upper bound (without
    the library it raises at the first call)."""
    want = common.override("w8a8_dense_kernel", W8A8_DENSE_KERNEL_ENV, W8A8_DENSE_KERNELS)
    lo, hi = DENSE_W8A8_ROWS
    if rows < lo:
        return None
    if want == "cublaslt":
        return want
    if want == "auto" and common.platform() == "cuda" and cublaslt_fp8_gemm.available()[0]:
        return "cublaslt"
    if rows <= hi:
        return "pallas" if want == "auto" else want
    return None


def pick_variant(variant: str, rows: int, weight_dtype) -> str:
    """The FP8 scheme a dense GEMM of ``rows`` rows runs: as given unless "auto"; "auto": W8A8 on CUDA
    where ``dense_w8a8_kernel`` names a kernel, else W8A16 (ROCm: Pallas-Triton takes no fnuz dot; CPU)."""
    if variant != "auto":
        return variant
    if common.platform() == "cuda" and fp8_weight_format(weight_dtype, "w8a8")[0] is not None:
        return "w8a8" if dense_w8a8_kernel(rows) else "w8a16"
    return "w8a16"


def pallas_plan(m: int, n: int, k: int, dtype, weight_dtype, variant: str = "w8a16",
                mode: str | None = None) -> Plan:
    """The Pallas ``block_scaled_matmul`` and its tiles, or XLA. Decode (m <= 64): one row tile, 128-deep K
    steps, K split until the programs about fill the GPU (the f32 partials kept under the weight bytes);
    larger m: 128 x 128 x 128 tiles, 8 warps."""
    use, forced = want_kernel(mode)
    if not use:
        return Plan("xla", reason="mode or platform")
    if jnp.dtype(dtype) not in common.FLOAT_DTYPES:
        return Plan("xla", reason=f"dtype {jnp.dtype(dtype)}")
    fmt, why = fp8_weight_format(weight_dtype, variant)
    if fmt is None:
        return Plan("xla", reason=why)
    if not forced and (n < 16 or k < 16):
        return Plan("xla", reason="dims below the Triton dot minimum (16)")
    w8a8_rows = variant == "w8a8" and DENSE_W8A8_ROWS[0] <= m <= DENSE_W8A8_ROWS[1]
    if not forced and m > W8A16_MAX_ROWS and common.platform() == "cuda" and not w8a8_rows:
        return Plan("xla", reason=f"above {W8A16_MAX_ROWS} rows XLA's dequantise-then-dot measured faster")
    cap = lambda b, d: max(16, min(b, pow2(d)))
    if m <= 64:
        p = dict(block_m=pow2(m, 16), block_n=cap(64 if n < 2048 else 128, n), block_k=128, num_warps=4,
                 num_stages=3)
    else:
        p = dict(block_m=128, block_n=cap(128, n), block_k=128, num_warps=8, num_stages=3)
    programs = -(-m // p["block_m"]) * -(-n // p["block_n"])
    m_pad = -(-m // p["block_m"]) * p["block_m"]
    p["num_splits"] = max(1, min(-(-common.num_compute_units() // programs), k // (4 * m_pad), -(-k // 128) // 2))
    if common.platform() == "rocm":
        p["num_stages"] = 2
    return Plan("pallas", dict(p, variant=variant, weight_format=fmt), plan_reason(forced))


def triton_params(m: int, n: int, k: int) -> dict:
    """Tiles of the Triton W8A8 dense GEMM: 64 x 128 x 128, 4 warps, grouped launch (the best of the
    torch-Triton probe at M 128-2048, N = K = 7168, benchmarks/2026-12-05c/h100/fp8_probe/)."""
    return dict(block_m=max(16, min(64, pow2(m))), block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)


def plan(m: int, n: int, k: int, dtype, weight_dtype, variant: str = "w8a16", mode: str | None = None,
         weight_format: str | None = None) -> Plan:
    """The path of an [m, k] x [n, k]^T GEMM in scheme ``variant`` ("w8a16" | "w8a8"): "cublaslt",
    "triton", "pallas" or "xla" (params["variant"]: the scheme it emulates)."""
    kernel = dense_w8a8_kernel(m) if variant == "w8a8" and want_kernel(mode)[0] else None
    if (kernel == "cublaslt" and jnp.dtype(weight_dtype) == jnp.dtype(jnp.float8_e4m3fn)
            and not cublaslt_fp8_gemm.check(n, k)):
        return Plan("cublaslt", dict(act_quant="triton" if jax_triton_compat.available()[0] else "xla"),
                    "w8a8_dense_kernel")
    p = pallas_plan(m, n, k, dtype, weight_dtype, variant, mode)
    if p.path != "pallas":
        return Plan("xla", dict(variant=variant), p.reason)
    if kernel == "triton" and variant == "w8a8" and triton_fp8_type(weight_dtype, weight_format) is not None:
        return Plan("triton", triton_params(m, n, k), "w8a8_dense_kernel")
    return Plan("pallas", dict(p.params, **({"weight_format": weight_format} if weight_format else {})), p.reason)


def run(x, w, scale, variant: str = "w8a16", out_dtype=None, mode: str | None = None,
        weight_format: str | None = None):
    """x [..., K] @ (w [N, K] * scale)^T -> [..., N] in ``out_dtype`` (default x's dtype) on the planned
    path; ``variant`` "auto": ``pick_variant`` picks from the rows."""
    lead, K = x.shape[:-1], x.shape[-1]
    variant = pick_variant(variant, x.size // K, w.dtype)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    x2 = x.reshape(-1, K)
    pl = plan(x2.shape[0], w.shape[0], K, x.dtype, w.dtype, variant, mode, weight_format)
    if pl.path == "cublaslt":
        quant = act_quant_triton if pl.params["act_quant"] == "triton" else None
        y = cublaslt_fp8_gemm.cublaslt_fp8_matmul(x2, w, scale, out_dtype=out_dtype, quant=quant)
    elif pl.path == "triton":
        y = block_fp8_matmul(x2, as_triton_fp8(w, triton_fp8_type(w.dtype, weight_format)), scale,
                             out_dtype=out_dtype, **pl.params)
    elif pl.path == "pallas":
        y = block_scaled_matmul(x2, w, scale, out_dtype=out_dtype, **pl.params)
    else:
        return xla(x, w, scale, pl.params["variant"], out_dtype, weight_format)
    return y.reshape(*lead, w.shape[0])


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
    """Operand dtype of the XLA paths: float32 on CPU (XLA:CPU widens bf16 dots anyway, and then the path
    computes the kernels' function exactly), else the activation dtype (the dequantised weights rounded
    to it: ~3e-3 relative on bf16 outputs)."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(dtype)


def xla(x, w, scale, variant: str = "w8a16", out_dtype=None, weight_format: str | None = None):
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
