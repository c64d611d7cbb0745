"""FP8 e4m3 block-scaled weights (DeepSeek-V3's native format).

A quantised ``X.weight`` [out, in] comes with ``X.weight_scale_inv``
[ceil(out/bo), ceil(in/bi)]: the real weight is ``weight * scale_inv`` per block.
For now they are dequantised on load.
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
    """float weight [out, in] -> (float8_e4m3fn weight, float32 scale_inv). For tests and tiny checkpoints."""
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
