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
from jax._src import distributed  # the key-value store jax.distributed.initialize starts (no public API)

from moejax.kernels import common as kernels_common

DISPATCH_TARGET = "moejax_ep_dispatch"
COMBINE_TARGET = "moejax_ep_combine"

# platform -> (library, its dispatch and combine handlers by XLA FFI stage, what building it needs)
IMPLEMENTATIONS = {
    "cpu": ("libmoejax_ep_host.so", {"execute": "MoejaxEpDispatchHost"}, {"execute": "MoejaxEpCombineHost"},
            "cmake, a C++17 compiler and jaxlib's XLA FFI headers"),
    # MoRI's handles are created in the initialize stage (outside command-buffer capture)
    "rocm": ("libmoejax_ep_mori.so",
             {"initialize": "MoejaxEpDispatchMoriInitialize", "execute": "MoejaxEpDispatchMori"},
             {"initialize": "MoejaxEpCombineMoriInitialize", "execute": "MoejaxEpCombineMori"},
             "ROCm's hipcc and MoRI (MORI_ROOT: a MoRI install or the amd-mori wheel's mori/ directory)"),
}
MORI_UID_KEY = "moejax/ffi/mori_shmem_uid"
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
    _, dispatch_stages, combine_stages, _ = IMPLEMENTATIONS[platform]
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise FfiUnavailable(f"moe_backend 'ffi': {path} does not load ({e}); rebuild it (docs/ffi.md)") from e
    if platform == "rocm":
        _init_mori_shmem(lib)
    xla_platform = {"cpu": "cpu", "rocm": "ROCM"}[platform]
    for target, stages in ((DISPATCH_TARGET, dispatch_stages), (COMBINE_TARGET, combine_stages)):
        handlers = {stage: jax.ffi.pycapsule(getattr(lib, sym)) for stage, sym in stages.items()}
        jax.ffi.register_ffi_target(target, handlers if len(handlers) > 1 else handlers["execute"],
                                    platform=xla_platform)


def _check_mori_processes() -> None:
    """MoRI's shmem state is one PE per process (amd-mori 1.0.0: ShmemStatesSingleton, no multithread
    mode), so each process drives one GPU and the PEs are the processes, in the mesh's device order."""
    if jax.local_device_count() != 1:
        raise FfiUnavailable(
            f"moe_backend 'ffi' on rocm (MoRI) needs one GPU per process: MoRI's shmem holds one PE per process "
            f"(ShmemStatesSingleton), and this process has {jax.local_device_count()} GPUs; start one process per "
            f"GPU (jax.distributed.initialize), or use moe_backend 'a2a' in a single process")
    if [d.process_index for d in jax.devices()] != list(range(jax.process_count())):
        raise FfiUnavailable("moe_backend 'ffi' on rocm (MoRI): the devices (the expert-parallel axis) must be in "
                             "process order, as MoRI's PEs are")


def _init_mori_shmem(lib) -> None:
    """Initialises MoRI's shmem in this process, as PE jax.process_index(): process 0 makes a unique id
    and JAX's distributed key-value store hands it to the others."""
    _check_mori_processes()
    rank, n = jax.process_index(), jax.process_count()
    error = ctypes.create_string_buffer(1024)
    uid = (ctypes.c_uint8 * lib.MoejaxMoriUniqueIdBytes())()
    if rank == 0:
        if lib.MoejaxMoriUniqueId(uid, error, len(error)):
            raise FfiUnavailable(f"MoRI: {error.value.decode()}")
    if n > 1:
        client = distributed.global_state.client
        if rank == 0:
            client.key_value_set_bytes(MORI_UID_KEY, bytes(uid))
        else:
            uid[:] = client.blocking_key_value_get_bytes(MORI_UID_KEY, 300_000)
    device = jax.local_devices()[0].local_hardware_id
    if lib.MoejaxMoriInit(device, rank, n, uid, error, len(error)):
        raise FfiUnavailable(f"MoRI shmem initialisation failed on process {rank}: {error.value.decode()}")


def current_platform() -> str:
    """JAX's backend, with "gpu" resolved to "cuda" or "rocm" (JAX names both "gpu")."""
    backend = jax.default_backend()
    return kernels_common.platform() if backend == "gpu" else backend


def require(platform: str | None = None) -> str:
    """Registers the implementation for ``platform`` (default: the current one) and returns the
    platform; raises FfiUnavailable naming what is missing."""
    platform = platform or current_platform()
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
