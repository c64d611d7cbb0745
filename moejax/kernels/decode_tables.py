"""Whether decode attention's cost grows with the block-table width: what the engine's table widths
(moejax/engine/buckets.py) follow, from the decode plans of MLA (mla_decode.py) and MFA (mfa_decode.py)."""

from __future__ import annotations

from moejax.kernels import mfa_decode, mla_decode


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
