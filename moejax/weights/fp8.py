"""FP8 e4m3 block-scaled weights (DeepSeek-V3's native format).

A quantised ``X.weight`` [out, in] comes with ``X.weight_scale_inv``
[ceil(out/bo), ceil(in/bi)]: the real weight is ``weight * scale_inv`` per block.
The loader keeps them FP8 or dequantises them, as the engine's FP8 policy says
(moejax/layers/fp8_policy.py); these NumPy routines run at load time. The device format is
128 x 128 blocks only (the kernels step K in 128-deep scale blocks); a checkpoint with other blocks
is re-blocked on load (``reblock_fp8``) and its error measured against the checkpoint (``ReblockStats``).
"""

from __future__ import annotations

import dataclasses

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


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def reblock_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                want_block: tuple[int, int] = (128, 128)):
    """A float8 [out, in] matrix with ``block`` scales -> (float8 weight, float32 scales) in
    ``want_block`` blocks, and its error against the checkpoint: (||W' - W||_F / ||W||_F,
    max|W' - W| / max|W|), W the checkpoint's own dequantised matrix and W' the re-blocked one
    dequantised. Any ``block`` (dividing 128 or not, larger or smaller): W is dequantised with the
    checkpoint's scales and re-quantised per ``want_block`` block. Bound: each element is rounded once
    to e4m3 at its new block's scale S = amax/448, so |W' - W| <= half an e4m3 ulp: <= |W|/16 for
    normal values (3 mantissa bits), <= 2^-10 S for subnormal ones, and <= 16 S = amax/28 in all (the
    largest binade, [256, 448], has ulp 32). Hence the Frobenius ratio is <= 1/16 (+ the subnormal
    term, 2^-10/448 of the block max an element) and the max-abs ratio <= 1/28. A checkpoint block
    that holds its new block's max has the new scale already: its values stay exact."""
    ref = dequantize_block_fp8(weight, scale_inv, block)
    q, s = quantize_block_fp8(ref, want_block)
    diff = dequantize_block_fp8(q, s, want_block) - ref
    fro = _ratio(float(np.linalg.norm(diff)), float(np.linalg.norm(ref)))
    mx = _ratio(float(np.abs(diff).max(initial=0.0)), float(np.abs(ref).max(initial=0.0)))
    return q, s, (fro, mx)


@dataclasses.dataclass
class ReblockStats:
    """One load's re-blocking error, folded over its matrices: the maxima of each matrix's relative
    Frobenius error and of its max abs element error relative to its max abs (``reblock_fp8``), with
    the matrices they came from. ``summary()``: None when nothing was re-blocked."""
    checkpoint_block: tuple[int, int] | None = None
    device_block: tuple[int, int] = (128, 128)
    matrices: int = 0
    rel_frobenius: float = 0.0
    rel_max_abs: float = 0.0
    worst_frobenius: str | None = None
    worst_max_abs: str | None = None

    def add(self, name: str, block, want_block, err: tuple[float, float]) -> None:
        self.checkpoint_block, self.device_block = tuple(block), tuple(want_block)
        self.matrices += 1
        fro, mx = err
        if self.worst_frobenius is None or fro > self.rel_frobenius:
            self.rel_frobenius, self.worst_frobenius = fro, name
        if self.worst_max_abs is None or mx > self.rel_max_abs:
            self.rel_max_abs, self.worst_max_abs = mx, name

    def summary(self) -> dict | None:
        if not self.matrices:
            return None
        return {"checkpoint_block": list(self.checkpoint_block), "device_block": list(self.device_block),
                "matrices": self.matrices, "rel_frobenius": self.rel_frobenius, "rel_max_abs": self.rel_max_abs,
                "worst_frobenius": self.worst_frobenius, "worst_max_abs": self.worst_max_abs}

    def message(self) -> str:
        (bo, bi), (do, di) = self.checkpoint_block, self.device_block
        return (f"FP8 checkpoint with {bo}x{bi} weight blocks: the FP8 kernels take {do}x{di} blocks only, so "
                f"{self.matrices} FP8 matrices were re-blocked to {do}x{di} on load (dequantised with the "
                f"checkpoint's scales, re-quantised per {do}x{di} block; still FP8, 1 byte a weight). Error "
                f"against the checkpoint's own weights, max over matrices: {self.rel_frobenius:.3e} relative "
                f"(Frobenius, {self.worst_frobenius}), {self.rel_max_abs:.3e} max abs element error / the "
                f"matrix's max abs ({self.worst_max_abs}). weight_dtype=\"bf16\" loads the checkpoint's "
                f"weights exactly instead, at 2 bytes a weight.")


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
