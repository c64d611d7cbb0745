"""Kernels per operation: one module an operation plans its path once from static shapes, dtypes and the
platform (a frozen ``Plan``: which path, its params, why) and runs the path the plan names, XLA
included, so a layer makes one call and always gets a result.

common.py holds the mode and override machinery (``kernel_mode``, ``kernel_settings``, the engine's
kernel settings, ``KernelScopedModule``, ``shared_expert_fusion``) and the one power-of-two helper;
moe.py (bf16 routed experts), moe_fp8.py (block-FP8 routed experts), fp8_gemm.py (dense FP8 GEMM),
mla_decode.py, mfa_decode.py (paged decode attention; paged_decode.py their shared kernel tiling;
decode_tables.py what the engine's table widths follow) and prefill.py (prefill attention) one
operation each. The kernel bodies stay in pallas_kernels/.
"""
