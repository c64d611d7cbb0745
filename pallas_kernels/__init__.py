"""Pallas (Triton backend) kernels: fused MoE grouped GEMM and paged decode
attention (MLA and MFA).

Triton-portable (CUDA and ROCm): no Mosaic GPU, no wgmma-specific code. Every
kernel passes Triton compiler parameters explicitly (see compat.py). On CPU they
run in the Pallas interpreter (tests). The model reaches them only through
``moejax.kernels`` (one module an operation).
"""

