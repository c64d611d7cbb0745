"""Shared pieces of the block-FP8 kernels (fused_moe_fp8.py, block_scaled_matmul.py).

* ``act_quant``: per-token, per-128-channel activation quantisation to e4m3fn (plain JAX, run
  outside the kernels), DeepSeek-V3's ``act_quant``: scale = amax / 448, q = x / scale.
* ``load_weight`` / ``decode_e4m3_bits``: in-kernel conversion of an FP8 weight tile to the dot's
  dtype. ``weight_format`` says how the weight bytes are stored:

  - ``"e4m3fn"``: a float8_e4m3fn array, converted with ``astype`` (Triton ``fp_to_fp``; needs
    compute capability 8.9+ on NVIDIA).
  - ``"e4m3fn_bits"`` / ``"e4m3fnuz_bits"``: the same bytes as uint8, decoded with integer
    arithmetic (sign / exponent / mantissa fields into a float32 bit pattern, bitcast), so no FP8
    type ever reaches Triton. ``e4m3fnuz_bits`` is the ROCm route: MI300X (gfx942) takes
    float8_e4m3fnuz, and Pallas-Triton raises NotImplementedError for casts from that type
    (jax 0.10 / 0.11, ``_UNSUPPORTED_CAST_DTYPES``). ``e4m3fn_bits`` also runs on GPUs without FP8
    conversions (compute capability < 8.9).

  What was run: the decode is checked bit-exactly against ml_dtypes for all 256 codes of both
  formats on CPU, the kernels using it numerically in the Pallas interpreter (CPU), and their
  lowering to Triton IR for ``cuda`` and ``rocm`` (no PTX / HSACO built). Not run: no AMD GPU, no
  MI300X; nothing here has run on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_fp8_dots

triton_fp8_dots.install()  # FP8 dots on Hopper's wgmma (the module says why)

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
INV_FP8_MAX = 1.0 / 448.0  # a product, not a division: XLA rewrites x / 448 so, NumPy does not
SCALE_BLOCK = 128  # DeepSeek-V3's weight_block_size, both axes; also the activation group
ACT_EPS = 1e-10  # amax floor of an all-zero group (SGLang's eps): its scale stays finite, q = 0
VARIANTS = ("w8a16", "w8a8")
WEIGHT_FORMATS = ("e4m3fn", "e4m3fn_bits", "e4m3fnuz_bits")
_BIAS = {"e4m3fn_bits": 7, "e4m3fnuz_bits": 8}


def check_variant(variant: str, weight_format: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if variant == "w8a8" and weight_format != "e4m3fn":
        raise ValueError("w8a8 takes e4m3fn weights (an fp8 x fp8 dot); the *_bits formats are W8A16 only")


def check_blocks(block_n: int, block_k: int, what: str = "") -> None:
    """A K step must lie in one 128-block of the scale grid (block_k a power of two <= 128); a column
    tile covers a whole number of 128-blocks or a part of one (block_n | 128 or 128 | block_n)."""
    if block_k > SCALE_BLOCK or SCALE_BLOCK % block_k:
        raise ValueError(f"{what}block_k={block_k} must divide {SCALE_BLOCK}")
    if SCALE_BLOCK % block_n and block_n % SCALE_BLOCK:
        raise ValueError(f"{what}block_n={block_n} must divide {SCALE_BLOCK} or be a multiple of it")


def storage(w, weight_format: str | None = None):
    """(array the kernel reads, weight_format) for an FP8 weight: float8_e4m3fn stays as is (or its
    bytes as uint8 for ``e4m3fn_bits``), float8_e4m3fnuz goes in as its bytes (uint8), uint8 is taken
    as the bytes of ``weight_format`` (which must then be given)."""
    dt = jnp.dtype(w.dtype)
    if dt == jnp.dtype(jnp.float8_e4m3fnuz):
        if weight_format not in (None, "e4m3fnuz_bits"):
            raise ValueError(f"float8_e4m3fnuz weights need weight_format 'e4m3fnuz_bits', got {weight_format!r}")
        return jax.lax.bitcast_convert_type(w, jnp.uint8), "e4m3fnuz_bits"
    if dt == jnp.dtype(FP8):
        if weight_format in (None, "e4m3fn"):
            return w, "e4m3fn"
        if weight_format == "e4m3fn_bits":
            return jax.lax.bitcast_convert_type(w, jnp.uint8), weight_format
        raise ValueError(f"float8_e4m3fn weights cannot be read as {weight_format!r}")
    if dt == jnp.dtype(jnp.uint8):
        if weight_format not in _BIAS:
            raise ValueError(f"uint8 weights need weight_format in {tuple(_BIAS)}, got {weight_format!r}")
        return w, weight_format
    raise TypeError(f"FP8 weights must be float8_e4m3fn, float8_e4m3fnuz or uint8 bytes, got {dt}")


def act_quant(x, group: int = SCALE_BLOCK, dtype=FP8):
    """x [M, K] -> (x_q [M, K] ``dtype``, x_scale [M, cdiv(K, group)] float32) with
    x ~= x_q * x_scale per token and per ``group`` consecutive channels (the last group may be cut
    by the edge). scale = max(amax, 1e-10) * float32(1/448) (bit-identical in XLA and NumPy);
    q = x / scale rounded to nearest even. ``dtype`` float8_e4m3fnuz (MI300X) uses its own largest
    value, 240."""
    M, K = x.shape
    G = pl.cdiv(K, group)
    xf = x.astype(jnp.float32)
    if G * group != K:
        xf = jnp.pad(xf, ((0, 0), (0, G * group - K)))
    xg = xf.reshape(M, G, group)
    scale = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), ACT_EPS) * inv_fp8_max(dtype)
    q = (xg / scale[..., None]).astype(dtype).reshape(M, G * group)[:, :K]
    return q, scale


def inv_fp8_max(dtype) -> float:
    """1 / the largest finite value of an FP8 type (448 for e4m3fn, 240 for e4m3fnuz), as a product."""
    return INV_FP8_MAX if jnp.dtype(dtype) == jnp.dtype(FP8) else 1.0 / float(jnp.finfo(dtype).max)


def act_dequant(q, scale, group: int = SCALE_BLOCK):
    """Inverse of ``act_quant`` (float32)."""
    M, K = q.shape
    s = jnp.repeat(scale, group, axis=1)[:, :K]
    return q.astype(jnp.float32) * s


def decode_e4m3_bits(bits, weight_format: str):
    """uint8 (or int32) codes of e4m3fn (bias 7) / e4m3fnuz (bias 8) -> float32, exactly, with integer
    ops and one bitcast (usable inside Triton kernels: no FP8 type involved). NaN codes decode to NaN
    (fn: 0x7F, 0xFF; fnuz: 0x80); fnuz has no -0."""
    bias = _BIAS[weight_format]
    b = bits.astype(jnp.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = b & 0x7
    neg = b >= 0x80
    sign = jnp.where(neg, jnp.int32(-(1 << 31)), jnp.int32(0))  # float32 sign bit
    normal = jax.lax.bitcast_convert_type(sign | ((e + (127 - bias)) << 23) | (m << 20), jnp.float32)
    sub = m.astype(jnp.float32) * (2.0 ** (-bias - 2))  # (m / 8) * 2**(1 - bias); never an f32 denormal
    v = jnp.where(e == 0, jnp.where(neg, -sub, sub), normal)
    nan = (b & 0x7F) == 0x7F if weight_format == "e4m3fn_bits" else b == 0x80
    return jnp.where(nan, jnp.float32(jnp.nan), v)


def load_weight(tile, weight_format: str, dtype):
    """An FP8 weight tile as loaded (float8_e4m3fn, or uint8 codes) -> ``dtype`` (the dot operand)."""
    if weight_format == "e4m3fn":
        return tile.astype(dtype)
    return decode_e4m3_bits(tile, weight_format).astype(dtype)


def zero_where_not(mask, x):
    """jnp.where(mask, x, 0) for any dtype, FP8 included (FP8 via its bytes: selects and zero constants
    of an FP8 type are kept out of the Triton IR)."""
    if jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
        b = jax.lax.bitcast_convert_type(x, jnp.uint8)
        return jax.lax.bitcast_convert_type(jnp.where(mask, b, jnp.zeros((), jnp.uint8)), x.dtype)
    return jnp.where(mask, x, jnp.zeros((), x.dtype))
