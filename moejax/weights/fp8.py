"""FP8 e4m3 block-scaled weights (DeepSeek-V3's native format).

A quantised ``X.weight`` [out, in] comes with ``X.weight_scale_inv``
[ceil(out/bo), ceil(in/bi)]: the real weight is ``weight * scale_inv`` per block.
The loader keeps them FP8 or dequantises them, as the engine's FP8 policy says
(moejax/layers/fp8_policy.py); these NumPy routines run at load time.
"""

import ml_dtypes
import numpy as np


def dequantize_block_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    bo, bi = block
    out, inn = weight.shape
    expect = (-(-out // bo), -(-inn // bi))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {weight.shape} "
                         f"with blocks {block}: expected {expect}")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:out, :inn]
    return weight.astype(np.float32) * s


def quantize_block_fp8(weight: np.ndarray, block: tuple[int, int] = (128, 128)):
    """float weight [out, in] -> (float8_e4m3fn weight, float32 scale_inv): at load (weight_dtype="fp8"
    on a bf16 checkpoint) and for tiny checkpoints."""
    bo, bi = block
    out, inn = weight.shape
    nbo, nbi = -(-out // bo), -(-inn // bi)
    padded = np.zeros((nbo * bo, nbi * bi), np.float32)
    padded[:out, :inn] = weight
    blocks = padded.reshape(nbo, bo, nbi, bi)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)  # 448 = e4m3 max
    q = (blocks / scale[:, None, :, None]).reshape(nbo * bo, nbi * bi)[:out, :inn]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def e4m3fn_to_e4m3fnuz(weight: np.ndarray, scale: np.ndarray):
    """float8_e4m3fn weight + its float32 scales -> (float8_e4m3fnuz weight, scales * 2): the same real
    values in the format MI300X (gfx942) computes with.

    Bit for bit: 0x80 (-0 in fn, NaN in fnuz) -> 0x00; fn's NaN codes 0x7F / 0xFF -> 0x80 (fnuz's
    only NaN); every other code keeps its bits. fnuz's exponent bias is 8 against fn's 7, so the same
    bits mean half the value, and the scales double (exact in float32). fn's largest finite value
    (448, 0x7E) is 224 in fnuz, inside its range (max 240). ``weight`` may also be given as its
    uint8 bytes; scales of any shape (per block, per tensor). Checked for all 256 codes on CPU with
    ml_dtypes (tests/test_fp8_kernels.py); never run on an MI300X (no AMD GPU here). The Pallas
    kernels read fnuz weights as their bytes (``weight_format="e4m3fnuz_bits"``)."""
    w = np.asarray(weight)
    if w.dtype == np.uint8:
        bits = w
    elif w.dtype == ml_dtypes.float8_e4m3fn:
        bits = w.view(np.uint8)
    else:
        raise TypeError(f"expected float8_e4m3fn (or its uint8 bytes), got {w.dtype}")
    out = np.where(bits == 0x80, np.uint8(0), bits)
    out = np.where((bits & 0x7F) == 0x7F, np.uint8(0x80), out).astype(np.uint8)
    return out.view(ml_dtypes.float8_e4m3fnuz), np.asarray(scale, np.float32) * np.float32(2)
