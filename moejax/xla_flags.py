"""The XLA flags moejax's programs need, set in one place (before JAX creates its backends).

Every platform (XLA:CPU parses and ignores these GPU options):

- ``--xla_gpu_enable_latency_hiding_scheduler=true``: XLA:GPU's scheduler that moves an async
  collective's start early and its done late, so independent kernels run between them; dual-batch
  overlap (docs/dbo.md) relies on it to put one micro-batch's compute under the other's all-to-all.
- ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: two collectives in flight at once
  (the default, 1, would serialise micro-batch 0's combine with micro-batch 1's dispatch).

Where JAX runs on the CPU only (``cpu_only``: the tiny default server, tests, CI), what makes start-up
compilation fit a 2-core machine (every program is compiled before /health answers 200; the cost in step
time and compile time is in BENCHMARKS.md, "2026-12-07b start-up (CPU)"):

- ``--xla_backend_optimization_level=0``: LLVM's codegen at -O0; the HLO and its fusions are XLA's usual
  ones, so the programs compute the same values.
- ``--xla_cpu_use_fusion_emitters=false`` (jaxlib 0.10 only: XLA aborts on a flag it no longer knows):
  each fusion's loop emitted straight to LLVM IR instead of through the MLIR emitters, the same HLO and
  fusions.
- ``--xla_cpu_parallel_codegen_split_count=1`` (jaxlib 0.10 only, as above): a program's LLVM module compiled as one
  module, not split into 32 for a thread pool: on 2 cores a model step of the tiny default compiles in ~25%
  less time (BENCHMARKS.md "2026-12-07f start-up (CPU)"); the same machine code, only how it is partitioned.

A value the user already set in XLA_FLAGS wins; once a backend exists, XLA has read its flags and this
changes nothing (a warning says so).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from importlib.metadata import version

import jax

from jax._src import xla_bridge  # whether a backend exists (no public API); importing jax starts none

FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
}
CPU_FLAGS = {"xla_backend_optimization_level": "0"}
CPU_FLAGS_JAXLIB_0_10 = {"xla_cpu_use_fusion_emitters": "false", "xla_cpu_parallel_codegen_split_count": "1"}
GPU_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")


def cpu_only(env=os.environ) -> bool:
    """Whether JAX runs on the CPU here, decided without starting a backend (jax.distributed.initialize
    must come first in a multi-process job): JAX_PLATFORMS, else the backends already started, else
    whether a GPU plugin is installed."""
    platforms = (env.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if getattr(xla_bridge, "_backends", None):
        return jax.default_backend() == "cpu"
    return not any(importlib.util.find_spec(m) for m in GPU_PLUGINS)


def _jaxlib_minor() -> tuple[int, int] | None:
    try:
        return tuple(int(x) for x in version("jaxlib").split(".")[:2])
    except Exception:  # noqa: BLE001 - not installed as a distribution, or an odd version: no versioned flag
        return None


def wanted(env=os.environ) -> dict[str, str]:
    """The flags this process should run with (before the user's)."""
    out = dict(FLAGS)
    if cpu_only(env):
        out.update(CPU_FLAGS)
        if _jaxlib_minor() == (0, 10):
            out.update(CPU_FLAGS_JAXLIB_0_10)
    return out


def set_xla_flags(env=os.environ) -> list[str]:
    """Adds the flags not already in ``env["XLA_FLAGS"]``; returns those added."""
    current = env.get("XLA_FLAGS", "")
    have = {f.lstrip("-").split("=", 1)[0] for f in current.split()}
    added = [f"--{k}={v}" for k, v in wanted(env).items() if k not in have]
    if not added:
        return []
    started = bool(getattr(xla_bridge, "_backends", None))
    if started:
        warnings.warn(f"JAX's backends already exist, so XLA will not see {added}: import moejax before running "
                      "any JAX computation (or set them in XLA_FLAGS)", stacklevel=2)
        return []
    env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
