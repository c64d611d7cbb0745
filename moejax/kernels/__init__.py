"""Kernel selection: Pallas (Triton) kernels on GPU, XLA everywhere else (see selection.py)."""

from moejax.kernels.selection import (  # noqa: F401
    KERNEL_MODES, KernelScopedModule, current_mode, kernel_mode, select_mfa, select_mla, select_moe,
)
