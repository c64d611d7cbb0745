"""Version shims for the Pallas Triton API (jax 0.10.x here, 0.11.x on the GPU machine).

``compiler_params(num_warps, num_stages)`` builds the Triton compiler parameters
whatever the class is called (``CompilerParams`` now, ``TritonCompilerParams`` in
older releases). ``interpret_mode()`` says whether kernels run in the Pallas
interpreter: always on CPU, and anywhere when ``MOEJAX_PALLAS_INTERPRET=1``.
"""

from __future__ import annotations

import os

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for the kernels)
from jax.experimental.pallas import triton as plt

_PARAMS_CLS = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams", None)
if _PARAMS_CLS is None:  # pragma: no cover - a jax that keeps the class on pallas itself
    _PARAMS_CLS = getattr(pl, "TritonCompilerParams")

INTERPRET_ENV = "MOEJAX_PALLAS_INTERPRET"


def compiler_params(num_warps: int, num_stages: int):
    return _PARAMS_CLS(num_warps=num_warps, num_stages=num_stages)


def interpret_mode() -> bool:
    if os.environ.get(INTERPRET_ENV, "") not in ("", "0"):
        return True
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def platform() -> str:
    """'cuda', 'rocm' or 'cpu' (anything else counts as 'cpu': no Triton)."""
    backend = jax.default_backend()
    if backend in ("cuda", "rocm"):
        return backend
    if backend == "gpu":
        try:
            version = jax.devices()[0].client.platform_version.lower()
        except Exception:  # pragma: no cover
            version = ""
        return "rocm" if "rocm" in version or "hip" in version else "cuda"
    return "cpu"


def masked_load(ref, mask, other=0):
    """``plt.load(ref, mask=..., other=...)``: Triton-style masked load of a ref view."""
    return plt.load(ref, mask=mask, other=other)
