"""What every operation's plan reads: the kernel mode, the engine's kernel settings and their overrides,
the platform, and the plan object.

The mode ("auto" | "pallas" | "xla") comes from ``moejax.load(kernels=...)`` and is read at trace time
from a context variable: ``Model`` wraps its Flax module in ``KernelScopedModule``, whose ``apply`` sets
the mode while the step is traced. "auto" = the kernels on GPU (CUDA or ROCm) where the shapes suit
them, else XLA. "pallas" forces the kernels everywhere; on CPU they run in the Pallas interpreter
(slow: tests only). ``MOEJAX_PALLAS_INTERPRET=1`` forces the interpreter on GPU as well (debugging).

The kernel overrides are engine settings (moejax/engine_args.py: ``moe_kernel``, ``w8a8_kernel``,
``w8a8_dense_kernel``, ``mla_kernel``, ``mfa_kernel``), set while the step is traced (``kernel_settings``) and read by
each operation's rule through ``override``; a setting left at "auto" falls back to its environment
variable (``MOEJAX_MOE_KERNEL``, ...: for kernel tests and measuring scripts without an engine), then
to the rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import compat, triton_fp8_dots

KERNEL_MODES = ("auto", "pallas", "xla")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("moejax_kernels", default="auto")
# The engine's settings (an EngineArgs, or anything with its kernel fields) while its step is traced.
_SETTINGS: contextvars.ContextVar[Any] = contextvars.ContextVar("moejax_kernel_settings", default=None)
SHARED_FUSION = ("auto", "on", "off")
# Each kernel override's choices and environment variable (the engine settings moe_kernel, w8a8_kernel,
# w8a8_dense_kernel, mla_kernel, mfa_kernel of moejax/engine_args.py; the rules that read them: moe.moe_kernel,
# moe_fp8.w8a8_kernel, fp8_gemm.dense_w8a8_kernel, mla_decode.mla_kernel, mfa_decode.mfa_kernel).
MOE_KERNELS, MOE_KERNEL_ENV = ("auto", "pallas", "triton"), "MOEJAX_MOE_KERNEL"
W8A8_KERNELS, W8A8_KERNEL_ENV = ("auto", "triton", "pallas"), "MOEJAX_W8A8_KERNEL"
W8A8_DENSE_KERNELS, W8A8_DENSE_KERNEL_ENV = ("auto", "pallas", "triton", "cublaslt"), "MOEJAX_W8A8_DENSE_KERNEL"
MLA_KERNELS, MLA_KERNEL_ENV = ("auto", "pallas", "triton", "mgpu"), "MOEJAX_MLA_KERNEL"
MFA_KERNELS, MFA_KERNEL_ENV = ("auto", "pallas", "mgpu"), "MOEJAX_MFA_KERNEL"
_FUSE_SHARED: contextvars.ContextVar[str] = contextvars.ContextVar("moejax_fuse_shared", default="auto")
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))  # the kernels' inputs


@dataclasses.dataclass(frozen=True)
class Plan:
    """An operation's path ("xla", "pallas", "triton", "cublaslt", ...), its params, and why."""
    path: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: str = ""


def check_mode(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value):
    """``var`` set to ``value`` for everything traced inside the block (the trace-time settings below)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def kernel_mode(mode: str):
    """Kernels used by everything traced inside the block."""
    return _scoped(_MODE, check_mode(mode))


def current_mode() -> str:
    return _MODE.get()


def kernel_settings(settings):
    """The engine's kernel settings (moe_kernel, w8a8_kernel, ...; moejax/engine_args.py) for everything
    traced inside the block; None: none (each override then reads its environment variable)."""
    return _scoped(_SETTINGS, settings)


def override(name: str, env: str, choices: tuple[str, ...]) -> str:
    """A kernel override: the engine's setting ``name`` where it is not "auto", else ``$env``, else "auto"."""
    want = getattr(_SETTINGS.get(), name, "auto")
    if want not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {want!r}")
    if want == "auto":
        want = os.environ.get(env, "auto")
        if want not in choices:
            raise ValueError(f"{env} must be one of {choices}, got {want!r}")
    return want


def shared_expert_fusion(setting: str):
    """Shared experts inside the routed-expert kernel ("on"), beside it as their own MLP ("off"), or
    "auto" (moe.fuse_shared_experts' rule). Read at trace time, like ``kernel_mode``."""
    if setting not in SHARED_FUSION:
        raise ValueError(f"shared_expert_fusion must be one of {SHARED_FUSION}, got {setting!r}")
    return _scoped(_FUSE_SHARED, setting)


def shared_fusion_setting() -> str:
    return _FUSE_SHARED.get()


class KernelScopedModule:
    """A Flax module whose ``apply`` traces under ``kernel_mode(mode)``,
    ``shared_expert_fusion(fuse_shared)`` and ``kernel_settings(settings)`` (the engine's EngineArgs:
    its kernel overrides; its ``fp8_fast_accum`` set for the lowering that follows); everything else
    delegates."""

    def __init__(self, module, mode: str, fuse_shared: str = "auto", settings=None):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "kernels", check_mode(mode))
        object.__setattr__(self, "fuse_shared", fuse_shared)
        object.__setattr__(self, "settings", settings)

    @contextlib.contextmanager
    def scope(self):
        """What ``apply`` traces under: this engine's kernel choices."""
        if self.settings is not None:  # a lowering choice of the process (pallas_kernels/triton_fp8_dots.py)
            triton_fp8_dots.set_fast_accumulation(self.settings.fp8_fast_accum)
        with kernel_mode(self.kernels), shared_expert_fusion(self.fuse_shared), kernel_settings(self.settings):
            yield

    def apply(self, *args, **kwargs):
        with self.scope():
            return self._module.apply(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)

    def __repr__(self):
        return f"KernelScopedModule({self._module!r}, kernels={self.kernels!r})"


@functools.lru_cache(maxsize=None)
def platform() -> str:
    """'cuda', 'rocm' or 'cpu' (anything else counts as 'cpu': no Triton); pallas_kernels.compat's rule."""
    return compat.platform()


@functools.lru_cache(maxsize=None)
def hopper() -> bool:
    """A CUDA device of compute capability 9.x (H100 / H200 / H800 / H20): wgmma and TMA (Mosaic GPU kernels)."""
    if platform() != "cuda":
        return False
    try:
        return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
    except Exception:  # pragma: no cover
        return False


@functools.lru_cache(maxsize=None)
def num_compute_units() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:  # pragma: no cover
        return 132


def want_kernel(mode: str | None) -> tuple[bool, bool]:
    """(use a kernel if the shapes allow, forced) for ``mode`` (None: the current ``kernel_mode``)."""
    mode = check_mode(mode or current_mode())
    if mode == "xla":
        return False, False
    if mode == "pallas":
        return True, True
    return platform() != "cpu", False


def pow2(n: int, lo: int = 1, down: bool = False) -> int:
    """The power of two nearest ``n`` from above (``down``: from below), at least ``lo``: Triton blocks
    are powers of two."""
    p = 1 << (max(n, 1).bit_length() - 1) if down else 1 << max(n - 1, 0).bit_length()
    return max(lo, p)


def triton_dim(n: int) -> bool:
    """A dim the kernels take as one Triton block: a power of two, at least 16 (the dot minimum)."""
    return n >= 16 and n & (n - 1) == 0


def plan_reason(forced: bool) -> str:
    return "forced" if forced else "gpu"


def einsum_f32(spec: str, a, b):
    """einsum with float32 accumulation and result.

    XLA:CPU's batched dot has no bf16 x bf16 -> f32 kernel, so on CPU the
    operands are widened instead; on GPU the MXU/tensor-core path keeps bf16 inputs.
    """
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
