"""What the engine's cache follows from the decode plans of MLA (mla_decode.py) and MFA (mfa_decode.py):
whether decode attention's cost grows with the block-table width (the table widths of
moejax/engine/buckets.py), and the width a cache row is allocated with."""

from __future__ import annotations

import jax.numpy as jnp

from moejax.kernels import kv_quant, mfa_decode, mla_decode
from pallas_kernels.mgpu_decode_attention import fp8_row_dim


def decode_reads_whole_table(cfg, cache_dtype, mode: str) -> bool:
    """True where the XLA gather path reads every column (the engine then keeps several table widths),
    False where the kernel reads each sequence's live tiles only (then only the longest)."""
    probe_len = 1 << 12  # the path does not depend on the length (only the kernel's tiling does)
    if hasattr(cfg, "kv_lora_rank"):  # MLA
        p = mla_decode.plan(1, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, probe_len, 16,
                            cache_dtype, mode)
    else:  # MFA
        p = mfa_decode.plan(1, cfg.num_attention_heads, cfg.head_dim, cfg.num_attention_groups, probe_len, 16,
                            cache_dtype, mode)
    return p.path == "xla"


def cache_row_dim(cfg, kv_cache_dtype: str, mode: str = "auto") -> int:
    """The width a cache row is allocated with: kv_quant's (the values; FP8: their scale byte, 16-byte
    padding), rounded up to whole 128-byte tiles where MLA decode reads FP8 rows with the Mosaic GPU kernel's
    TMA copies (mgpu_decode_attention.fp8_row_dim: +8% for DeepSeek-V3, so only where that kernel runs).
    Every reader takes the values and the scale at their columns and ignores the padding."""
    row = kv_quant.cache_row_dim(cfg.kv_cache_dim, kv_cache_dtype)
    if kv_cache_dtype != "fp8" or not hasattr(cfg, "kv_lora_rank"):
        return row
    p = mla_decode.plan(1, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 1 << 12, 16,
                        jnp.dtype(kv_quant.FP8), mode)
    return max(row, fp8_row_dim(cfg.kv_cache_dim)) if p.path == "mgpu" else row
