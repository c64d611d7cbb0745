"""Absorbed MLA decode over the paged cache (rows [kv_lora latent | rotated rope key]): the Triton
``triton_mla_decode``, the Pallas ``paged_decode_attention`` or XLA's gather path (``xla``). ``plan``
decides once from the shapes, the cache dtype and the platform; ``run`` computes its path.

Rule: on Hopper the Mosaic GPU kernel (``mgpu``) over bf16 caches at multiples of 64 heads; else Triton for an
FP8 cache with 64+ heads on CUDA with jax-triton (Hopper: up to 216 KB of shared memory; ROCm's 64 KB of LDS
cannot hold its tiles); else Pallas (fewer heads over FP8: its gather tile, 11-14% faster than Triton at 16
heads), or XLA for an FP8 cache with 64+ heads (paged_decode.slow_fp8). Several query rows a sequence (the
speculative verify): together in the Triton kernel (a sequence's context read once for all its rows) only
where one row leaves its 64-row tile part empty (``rows_together``), in the Mosaic GPU kernel where it is
forced (``mgpu_rows_together``: not yet measured); at 64+ heads each row on its own by default.
Measured: BENCHMARKS.md, "MLA and MFA decode kernels" (H100 tiling sweeps benchmarks/2026-12-07/h100/r1/mla128s.txt,
mla16s.txt and, FP8 on Pallas, benchmarks/2026-12-07d/h100/r1/; rows together or not
benchmarks/2026-12-07b/h100/r1/mla128.txt and mla16.txt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import common, paged_decode
from moejax.kernels.common import (MLA_KERNEL_ENV, MLA_KERNELS, Plan, einsum_f32, plan_reason, pow2, triton_dim,
                                   want_kernel)
from moejax.kernels.kv_quant import as_model_dtype, dequantize_rows, is_fp8_cache
from pallas_kernels import jax_triton_compat, mgpu_decode_attention as mgpu
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.triton_mla_decode import triton_mla_decode

# Triton tiling: (tokens a step, stages) by (FP8 cache, programs of 64 (query row, head) pairs). An FP8 cache
# at 64 pairs one stage (its rows widened in registers), below 32 tokens in two; bf16 three stages.
TRITON_TOKENS_STAGES = {(True, True): (64, 1), (True, False): (32, 2), (False, True): (64, 3), (False, False): (64, 3)}


def mla_kernel(heads: int, latent: int, rope: int, cache_dtype, rows: int = 1) -> str:
    """Which kernel runs MLA decode on a GPU: "triton" over an FP8 cache with 64+ heads on CUDA where
    jax-triton is installed, else "pallas" (or XLA where that is slower). The ``mla_kernel`` setting (or
    ``MOEJAX_MLA_KERNEL``) ``pallas|triton`` forces one (measuring)."""
    want = common.override("mla_kernel", MLA_KERNEL_ENV, MLA_KERNELS)
    if want != "auto":
        return want
    if mgpu_fits(heads, latent, rope, cache_dtype) and common.hopper() and mgpu.available()[0]:
        return "mgpu"
    ok = (common.platform() == "cuda" and paged_decode.slow_fp8(heads, cache_dtype) and triton_dim(latent)
          and triton_dim(rope))
    return "triton" if ok and jax_triton_compat.available()[0] else "pallas"


def mgpu_fits(heads: int, latent: int, rope: int, cache_dtype, block_size: int = 16, rows: int = 1) -> bool:
    """The Mosaic GPU kernel's shapes (pallas_kernels/mgpu_decode_attention.check_shapes): 64-head CTAs over a bf16
    cache, pages that tile its 64 tokens. Not FP8 caches yet: on jax 0.11.2 Mosaic tiles the rows' copies in
    128 bytes, which kv_quant's 592-byte rows are not (BENCHMARKS.md, 2026-12-07f); the kernel takes rows padded
    to 640 (mgpu_decode_attention.fp8_row_dim), not yet run on a GPU; where this admits FP8, the engine allocates
    such rows (decode_tables.cache_row_dim follows this plan)."""
    if paged_decode.fp8_cache(cache_dtype):
        return False
    try:
        mgpu.check_shapes(heads, latent, rope, 64, block_size, cache_dtype, jnp.bfloat16, rows)
    except ValueError:
        return False
    return True


def mgpu_params(batch: int, heads: int, max_len: int, rows: int = 1) -> dict:
    """Tiling of mgpu_mla_decode: 64-token tiles in two slots (what shared memory holds); context splits
    while the CTAs (64 heads of a sequence and split each, one an SM: 224 KB of shared memory) stay one wave,
    each split >= 1024 tokens. H100, 128 heads (BENCHMARKS.md 2026-12-07f): 16 x 2048 2 splits 44.0 us, 4
    59.5, 5 (two waves) 59.7; 16 x 8192 4 splits 101.3, 5 152.9, 2 166.9; 197 x 2048 1 split 373.6, 2 433.8."""
    ctas = batch * (heads // mgpu.heads_a_cta(rows))
    num_splits = max(1, min(max_len // 1024, common.num_compute_units() // max(ctas, 1), 16))
    return dict(block_t=64, num_stages=2, num_splits=num_splits)


def triton_params(batch: int, heads: int, max_len: int, fp8: bool = False) -> dict:
    """Tiling of triton_mla_decode: 64 (query row, head) pairs a program (one wgmma M tile, two warpgroups
    splitting the [64, 512] accumulator; fewer heads: the next power of two from 16, 4 warps); context
    splits until the programs fill the GPU, each split >= 256 tokens; tokens a step and stages from
    TRITON_TOKENS_STAGES."""
    block_h = 64 if heads >= 64 else pow2(heads, 16)  # heads: query rows x heads
    programs = batch * -(-heads // block_h)
    num_splits = max(1, min(max(1, max_len // 256), -(-common.num_compute_units() // max(programs, 1)), 16))
    block_n, stages = TRITON_TOKENS_STAGES[(fp8, block_h >= 64)]
    return dict(block_h=block_h, block_n=block_n, num_splits=num_splits, num_warps=8 if block_h >= 64 else 4,
                num_stages=stages)


def mgpu_rows_together(heads: int, latent: int, rope: int, cache_dtype, block_size: int, rows: int) -> bool:
    """Whether the Mosaic GPU kernel takes a sequence's ``rows`` query rows together (a CTA's 64 wgmma rows
    as rows x 64/rows heads: the context read once, the same products; 3 rows use 48 of the 64): where the
    kernel is forced (``mla_kernel=mgpu``: measuring) and the shapes fit. Not by default until measured
    against the rows each on their own (benchmarks/2026-12-07g/gpu1.sh d: not yet run on a GPU)."""
    forced = common.override("mla_kernel", MLA_KERNEL_ENV, MLA_KERNELS) == "mgpu"
    return forced and mgpu_fits(heads, latent, rope, cache_dtype, block_size, rows) and mgpu.available()[0]


def rows_together(batch: int, heads: int, rows: int, fp8: bool) -> bool:
    """Whether ``rows`` query rows a sequence run together in the Triton kernel (else each row on its own):
    below 64 heads (one row does not fill the 64-row tile), over an FP8 cache from 64 (row, head) pairs or
    256 sequences, over bf16 from 256 sequences (H100: 1.3-2.2x at 16 heads x 4 rows FP8; at 128 heads the
    rows alone were 10-20% faster over FP8, within noise over bf16)."""
    if heads >= 64 or rows < 2:
        return False
    return batch >= 256 or (fp8 and heads * rows >= 64)


def plan(batch: int, heads: int, latent: int, rope: int, max_len: int, block_size: int, cache_dtype,
         mode: str | None = None, rows: int = 1) -> Plan:
    """"mgpu" / "triton" / "pallas" with its tiling, or "xla". ``rows`` > 1 (query rows a sequence, ``batch``
    sequences): "rows" in the params where the Mosaic GPU or Triton kernel takes them together; else the
    plan is for one row a sequence and the caller gives every row its own block table."""
    use, forced = want_kernel(mode)
    if not use:
        return Plan("xla", reason="mode or platform")
    if not forced and not (triton_dim(latent) and triton_dim(rope) and heads >= 1):
        return Plan("xla", reason="latent / rope dims not powers of two >= 16 (Triton blocks)")
    fp8 = paged_decode.fp8_cache(cache_dtype)
    if rows > 1 and mgpu_rows_together(heads, latent, rope, cache_dtype, block_size, rows):
        return Plan("mgpu", dict(mgpu_params(batch, heads, max_len, rows), rows=rows), plan_reason(forced))
    if rows > 1:
        if forced or common.override("mla_kernel", MLA_KERNEL_ENV, MLA_KERNELS) != "auto":  # tests, measuring
            together = (forced or fp8) and mla_kernel(heads, latent, rope, cache_dtype, rows) == "triton"
        else:
            together = (common.platform() == "cuda" and jax_triton_compat.available()[0]
                        and rows_together(batch, heads, rows, fp8))
        if together:
            return Plan("triton", dict(triton_params(batch, heads * rows, max_len, fp8), rows=rows),
                        plan_reason(forced))
    kernel = mla_kernel(heads, latent, rope, cache_dtype)
    if kernel == "mgpu" and mgpu_fits(heads, latent, rope, cache_dtype, block_size):
        return Plan("mgpu", mgpu_params(batch, heads, max_len), plan_reason(forced))
    if kernel == "triton":
        return Plan("triton", triton_params(batch, heads, max_len, fp8), plan_reason(forced))
    if not forced and paged_decode.slow_fp8(heads, cache_dtype):
        return Plan("xla", reason=paged_decode.slow_fp8.__doc__)
    return Plan("pallas", paged_decode.params(batch, heads, max_len, block_size, cache_dtype), plan_reason(forced))


def run(q_latent, q_rope, cache, block_tables, seq_lens, block_size: int, scale: float, layer: int | None = None,
        mode: str | None = None, out_dtype=None, rows: int = 1):
    """q_latent [N, H, C], q_rope [N, H, R], cache [num_slots, C+R] (or [L, num_slots, C+R] with ``layer``),
    block_tables [N / rows, nb] (``rows`` query rows a sequence, consecutive), seq_lens [N] (>= 1)
    -> context latents [N, H, C] in ``out_dtype`` (default float32)."""
    N, H, C = q_latent.shape
    R, max_len = q_rope.shape[-1], block_tables.shape[1] * block_size
    kw = dict(block_size=block_size, scale=float(scale), layer=layer, out_dtype=out_dtype)
    if rows > 1:
        B = N // rows
        pl = plan(B, H, C, R, max_len, block_size, cache.dtype, mode, rows=rows)
        if "rows" in pl.params:
            params = {k: v for k, v in pl.params.items() if k != "rows"}
            fn = mgpu.mgpu_mla_decode if pl.path == "mgpu" else triton_mla_decode
            ctx = fn(q_latent.reshape(B, rows, H, C), q_rope.reshape(B, rows, H, R), cache, block_tables,
                     seq_lens.reshape(B, rows), **kw, **params)
            return ctx.reshape(N, H, C)
        block_tables = jnp.repeat(block_tables, rows, axis=0)
    pl = plan(N, H, C, R, max_len, block_size, cache.dtype, mode)
    if pl.path == "mgpu":
        return mgpu.mgpu_mla_decode(q_latent, q_rope, cache, block_tables, seq_lens, **kw, **pl.params)
    if pl.path == "triton":
        return triton_mla_decode(q_latent, q_rope, cache, block_tables, seq_lens, **kw, **pl.params)
    if pl.path == "pallas":
        return paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, **kw, **pl.params)
    return xla(q_latent, q_rope, cache, block_tables, seq_lens, block_size, scale, layer, out_dtype)


def xla(q_latent, q_rope, cache, block_tables, seq_lens, block_size: int, scale: float, layer: int | None = None,
        out_dtype=None):
    """One gather of each sequence's rows (block_tables [N, nb]), scores against the latents directly (K and
    V never expanded)."""
    slots = paged_decode.gather_sequence_slots(block_tables, block_size)
    if layer is not None and not isinstance(layer, int):  # a traced layer (a scanned one): one gather, no slice
        kv = cache[layer, slots]
    else:
        kv = cache[slots] if layer is None else cache[layer][slots]  # [B, T, C+R]
    C = q_latent.shape[-1]
    if is_fp8_cache(kv):
        kv = dequantize_rows(kv, C + q_rope.shape[-1]).astype(q_latent.dtype)
    kv = as_model_dtype(kv, q_latent.dtype)
    latent, k_rope = kv[..., :C], kv[..., C:]
    s = einsum_f32("bhc,btc->bht", q_latent.astype(kv.dtype), latent)
    s = s + einsum_f32("bhr,btr->bht", q_rope.astype(kv.dtype), k_rope)
    s = s * scale
    valid = jnp.arange(kv.shape[1])[None, :] < seq_lens[:, None]
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return einsum_f32("bht,btc->bhc", p.astype(kv.dtype), latent).astype(out_dtype or jnp.float32)
