"""What MLA and MFA decode share over the paged cache: the Pallas ``paged_decode_attention`` kernel's
tiling, the rule that keeps XLA for FP8 caches with many heads, and the XLA paths' cache read.

Measured: BENCHMARKS.md, "MLA and MFA decode kernels" (the H200 sweeps, benchmarks/2026-12-03b/).
"""

from __future__ import annotations

import jax.numpy as jnp

from moejax.kernels import common
from moejax.kernels.common import pow2

SLOW_FP8_HEADS = 64  # FP8 cache from this many heads: the page tile measured 0.42-0.53x XLA (H200, 128 heads)


def fp8_cache(cache_dtype) -> bool:
    return jnp.dtype(cache_dtype).itemsize == 1


def slow_fp8(heads: int, cache_dtype) -> bool:
    """FP8 cache with SLOW_FP8_HEADS+ heads: XLA beats the page tile."""
    return fp8_cache(cache_dtype) and heads >= SLOW_FP8_HEADS


def params(batch: int, heads: int, max_len: int, block_size: int, cache_dtype) -> dict:
    """Tiling of ``paged_decode_attention``, MLA and MFA alike. bf16 cache: the gather tile, 64 tokens
    across four pages in one dot; 32-head blocks (fewer page re-reads) once they give half a program per
    SM, else 32-token tiles; 16 heads take 16-head blocks (Triton dots need M >= 16; the CPU interpreter
    takes any). FP8 cache: below SLOW_FP8_HEADS heads the gather tile with 32 tokens and 2 stages (H100, 16
    heads: 320 us against the page tile's 402 at 256 x 2048); 64+ heads (forced) and ROCm the whole-page
    tile, one page a step. ROCm: 32 tokens and one stage (64 KB of LDS; not run: no AMD GPU here). The
    context is split until the programs fill the GPU, each split >= 256 tokens."""
    rocm, cpu = common.platform() == "rocm", common.platform() == "cpu"
    fp8 = fp8_cache(cache_dtype)
    block_h = 16 if heads >= 16 or not cpu else pow2(heads)
    block_t = 32 if rocm else 64
    if heads >= 32 and not fp8 and not rocm:
        if 2 * batch * -(-heads // 32) >= common.num_compute_units():
            block_h = 32
        else:
            block_t = 32
    programs = batch * -(-heads // block_h)
    max_splits = max(1, max_len // 256)
    num_splits = max(1, min(max_splits, -(-common.num_compute_units() // max(programs, 1)), 16))
    if fp8 and heads < SLOW_FP8_HEADS and not rocm:  # plain FP8 loads (no select): H100 sweep 2026-12-07d
        return dict(tile="gather", block_h=block_h, block_t=32, num_splits=num_splits, num_warps=4, num_stages=2)
    if fp8:
        return dict(tile="pages", block_h=block_h, block_t=block_size, num_splits=num_splits,
                    num_warps=4, num_stages=1 if rocm else 2)
    return dict(tile="gather", block_h=block_h, block_t=block_t, num_splits=num_splits, num_warps=4,
                num_stages=1 if rocm else (3 if block_h >= 32 else 2))


def gather_sequence_slots(block_tables, block_size: int):
    """block_tables [B, nb] -> flat cache slot of every position [B, nb*block_size]."""
    offs = jnp.arange(block_size, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * block_size + offs).reshape(block_tables.shape[0], -1)
