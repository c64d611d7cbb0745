"""Pallas (Triton backend) kernels: fused MoE grouped GEMM and MLA decode attention.

Triton-portable (CUDA and ROCm): no Mosaic GPU, no wgmma-specific code. Every
kernel passes Triton compiler parameters explicitly (see compat.py). On CPU they
run in the Pallas interpreter (tests). The model reaches them only through
``moejax.kernels.selection``.
"""

