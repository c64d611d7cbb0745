"""cuBLASLt's block-scaled FP8 GEMM (CUDA 12.9+, Hopper) as a JAX op: the XLA FFI target built from
ffi/cuda/fp8_block_gemm.cc (``ffi/cuda/build.sh``; docs/ffi.md).

Why: the dense W8A8 projections written in Triton (Pallas-Triton or the Triton language) reach about half
of the FP8 tensor-core rate at decode's M = 512 and lose to cuBLAS's bf16 GEMM (H100, benchmarks/
2026-12-06c: o_proj 16384 -> 7168 at M = 512, 323-340 us against bf16's 344 us in the microbenchmark,
0.17 vs 0.15 ms a layer in the step's profile): applying the per-block scales stalls their wgmma
pipeline. cuBLASLt's Hopper kernels take DeepSeek-V3's scales (128 x 128 on the weight, 1 x 128 on the
activations) in their epilogue-free main loop, as DeepGEMM does.

Layouts: x [M, K] bf16 (quantised here per token per 128 channels), w [N, K] float8_e4m3fn with HF's
weight_scale_inv [ceil(N/128), K/128] (multiplicative); K and N as ``check`` says. Output bf16.

Where the library is missing (not built, no CUDA) ``available()`` says why and kernel selection keeps the
Triton / Pallas kernels; calling the op then raises that reason."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.lib import xla_client  # the FFI target's traits (no public name for them)

from pallas_kernels.compat import platform
from pallas_kernels.fp8_utils import SCALE_BLOCK, act_quant

TARGET = "moejax_fp8_block_gemm"
LIBRARY = "libmoejax_fp8_gemm.so"
LIBRARY_DIR_ENV = "MOEJAX_FFI_LIBRARY_DIR"  # the directory of every moejax FFI library (docs/ffi.md)
_REPO = Path(__file__).resolve().parent.parent


def library_candidates() -> list[Path]:
    """Where the library is looked for: $MOEJAX_FFI_LIBRARY_DIR, the installed package (setup.py puts FFI
    libraries in moejax/parallel/), the default output of ffi/cuda/build.sh."""
    dirs = [os.environ[LIBRARY_DIR_ENV]] if os.environ.get(LIBRARY_DIR_ENV) else []
    return [Path(d, LIBRARY) for d in dirs + [_REPO / "moejax" / "parallel", _REPO / "ffi" / "cuda" / "build"]]


@functools.cache
def available() -> tuple[bool, str]:
    """(the target is registered for CUDA here, why not). Loads the library on first call."""
    if (plat := platform()) != "cuda":
        return False, f"cuBLASLt's FP8 GEMM runs on CUDA GPUs only (platform {plat})"
    path = next((p for p in library_candidates() if p.exists()), None)
    if path is None:
        return False, (f"{LIBRARY} not found in {[str(p.parent) for p in library_candidates()]}; build it with "
                       "bash ffi/cuda/build.sh (pip install runs it where it finds CUDA with cuBLAS 12.9+; docs/fp8.md)")
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        return False, f"{path} does not load ({e}); rebuild it with ffi/cuda/build.sh"
    # Command-buffer compatible: XLA keeps the call inside the step's CUDA graph (the handler's workspace is
    # its own, ffi/cuda/fp8_block_gemm.cc); without the trait each call split the graph.
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MoejaxFp8BlockGemm), platform="CUDA",
                                traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    return True, ""


def check(n: int, k: int) -> str:
    """Why cuBLASLt's block-scaled GEMM is not used for an [n, k] weight, or "" if it is: K in whole 128s (the
    scale blocks), N in 16s (16-byte rows). cuBLASLt reads both scale tensors with their leading dimension in
    fours; the wrapper pads them (the weight scales' K/128 unpadded gave wrong products at K = 256 on an H100,
    benchmarks/2026-12-06c/h100/rK/probe2.txt)."""
    if k % SCALE_BLOCK or n % 16:
        return f"needs K % 128 == 0 and N % 16 == 0, got N={n}, K={k}"
    return ""


@functools.partial(jax.jit, static_argnames=("out_dtype", "quant"))
def cublaslt_fp8_matmul(x, w, w_scale, *, out_dtype=jnp.bfloat16, quant=None):
    """x [M, K] @ (w [N, K] e4m3fn * w_scale [ceil(N/128), K/128])^T -> [M, N] ``out_dtype`` (computed in
    bf16). ``quant``: the activation quantiser, ``act_quant``'s contract (default ``act_quant``)."""
    M, K = x.shape
    N = w.shape[0]
    if w.ndim != 2 or w.shape[1] != K:
        raise ValueError(f"x [{M}, {K}] and w {tuple(w.shape)} (HF layout [out, in]) disagree on K")
    if jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"w must be float8_e4m3fn, got {w.dtype}")
    if why := check(N, K):
        raise ValueError(f"cublaslt_fp8_matmul {why}")
    if tuple(w_scale.shape) != (-(-N // SCALE_BLOCK), K // SCALE_BLOCK):
        raise ValueError(f"w_scale has shape {tuple(w_scale.shape)}, expected {(-(-N // SCALE_BLOCK), K // SCALE_BLOCK)}")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"cublaslt_fp8_matmul: {why}")
    Mp = -(-M // 4) * 4  # cuBLASLt's M-major activation scales take M in fours (M = 5 had no algorithm)
    xq, xs = (quant or act_quant)(jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x)
    # The activation scales M-major ([K/128, M]: what cuBLASLt reads for 128-element vectors on B; the
    # [M, K/128] layout gave 0.6 relative error on the device), the weight scales as HF stores them.
    ws = w_scale.astype(jnp.float32)
    if (kb := K // SCALE_BLOCK) % 4:  # the weight scales' rows in fours, as cuBLASLt reads them
        ws = jnp.pad(ws, ((0, 0), (0, -kb % 4)))
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((Mp, N), jnp.bfloat16))(xq, xs.T, w, ws)
    return y[:M].astype(out_dtype)
