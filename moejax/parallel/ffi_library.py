"""Finds, loads and registers the XLA FFI extension built from ffi/ (docs/ffi.md), per platform:
``cpu`` -> the host implementation (libmoejax_ep_host.so), ``rocm`` -> MoRI's (libmoejax_ep_mori.so).
Each is registered with XLA under the same target names, so the lowering is the same everywhere.
Where the library for the platform is missing, ``require`` raises an error naming what is missing
and how to build it; the other backends never touch this module."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax

DISPATCH_TARGET = "moejax_ep_dispatch"
COMBINE_TARGET = "moejax_ep_combine"

# platform -> (library, its dispatch and combine handler symbols, what building it needs)
IMPLEMENTATIONS = {
    "cpu": ("libmoejax_ep_host.so", "MoejaxEpDispatchHost", "MoejaxEpCombineHost",
            "cmake, a C++17 compiler and jaxlib's XLA FFI headers at install time"),
    "rocm": ("libmoejax_ep_mori.so", "MoejaxEpDispatchMori", "MoejaxEpCombineMori",
             "ROCm's hipcc and MoRI (MORI_ROOT: a MoRI install or the amd-mori wheel's mori/ directory) at install "
             "time, and MoRI's shared libraries at run time"),
}
# MOEJAX_FFI_LIBRARY_DIR: a directory holding the libraries, e.g. a CMake build of ffi/ (docs/ffi.md)
LIBRARY_DIR_ENV = "MOEJAX_FFI_LIBRARY_DIR"


class FfiUnavailable(RuntimeError):
    """The extension for this platform is not built or cannot be loaded."""


def library_path(platform: str) -> Path:
    name = IMPLEMENTATIONS[platform][0]
    override = os.environ.get(LIBRARY_DIR_ENV)
    return Path(override, name) if override else Path(__file__).resolve().parent / name


@functools.cache
def _register(platform: str, path: Path) -> None:
    _, dispatch_sym, combine_sym, _ = IMPLEMENTATIONS[platform]
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise FfiUnavailable(f"moe_backend 'ffi': {path} does not load ({e}); rebuild it (docs/ffi.md)") from e
    xla_platform = {"cpu": "cpu", "rocm": "ROCM"}[platform]
    for target, sym in ((DISPATCH_TARGET, dispatch_sym), (COMBINE_TARGET, combine_sym)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)), platform=xla_platform)


def require(platform: str | None = None) -> str:
    """Registers the implementation for ``platform`` (default: JAX's backend) and returns the platform;
    raises FfiUnavailable naming what is missing."""
    platform = platform or jax.default_backend()
    if platform not in IMPLEMENTATIONS:
        raise FfiUnavailable(
            f"moe_backend 'ffi' has no implementation for platform {platform!r}: there is the host one (cpu) and "
            f"MoRI's (rocm); on {platform} use moe_backend 'a2a' or 'ragged'")
    lib_name, _, _, needs = IMPLEMENTATIONS[platform]
    path = library_path(platform)
    if not path.is_file():
        raise FfiUnavailable(
            f"moe_backend 'ffi' on {platform} needs {lib_name}, which is not built (looked for {path}): it is built "
            f"by `pip install -e .` where {needs} are found (see docs/ffi.md); or use moe_backend 'a2a'")
    _register(platform, path)
    return platform


def available(platform: str | None = None) -> bool:
    """Whether ``require`` would succeed (for listings such as scripts/bench_ep.py's)."""
    try:
        require(platform)
    except FfiUnavailable:
        return False
    return True
