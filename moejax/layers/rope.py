"""Rotary embeddings with DeepSeek's YaRN scaling.

Frequencies are computed once on the host in float32 (as HF does), so the
compiled step only multiplies by positions.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = True  # DeepSeek rotates adjacent pairs (x0,x1),(x2,x3)...; Step3 rotates halves


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [dim/2] float32, attention_factor applied to cos/sin)."""
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extrap = (1.0 / pos_freqs).astype(np.float32)
    if rope.type == "default":
        return inv_extrap, 1.0
    factor = rope.factor
    inv_interp = (1.0 / (factor * pos_freqs)).astype(np.float32)

    def correction_dim(n_rot):
        return dim * math.log(rope.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrap_weight = 1 - ramp
    inv_freq = (inv_interp * (1 - extrap_weight) + inv_extrap * extrap_weight).astype(np.float32)
    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attn = yarn_mscale(factor)
    return inv_freq, float(attn)


def apply_rope(x, positions, inv_freq: np.ndarray, attention_factor: float, interleave: bool):
    """Rotates x [..., S, (heads,) dim] by positions [..., S].

    ``x`` has heads on axis -2 when it has one more axis than ``positions``
    plus the feature axis. For the interleaved layout the rotated pairs are
    written de-interleaved (evens then odds), as HF's DeepSeek-V3 does; since
    queries and keys go through the same function the dot products are the
    same as with the pairwise layout.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(freqs) * attention_factor
    sin = jnp.sin(freqs) * attention_factor
    if x.ndim == positions.ndim + 2:  # a heads axis sits between S and dim
        cos, sin = cos[..., None, :], sin[..., None, :]
    dtype, x = x.dtype, x.astype(jnp.float32)  # rotate in float32, as HF's V2 does
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)
