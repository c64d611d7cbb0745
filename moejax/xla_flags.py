"""The XLA flags moejax's programs need, set in one place (before JAX creates its backends).

- ``--xla_gpu_enable_latency_hiding_scheduler=true``: XLA:GPU's scheduler that moves an async
  collective's start early and its done late, so independent kernels run between them; dual-batch
  overlap (docs/dbo.md) relies on it to put one micro-batch's compute under the other's all-to-all.
- ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: two collectives in flight at once
  (the default, 1, would serialise micro-batch 0's combine with micro-batch 1's dispatch).

Both are GPU options (XLA:CPU parses and ignores them). A value the user already set in XLA_FLAGS
wins; once a backend exists, XLA has read its flags and this changes nothing (a warning says so).
"""

from __future__ import annotations

import os
import warnings

from jax._src import xla_bridge  # whether a backend exists (no public API); importing jax starts none

FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
}


def set_xla_flags(env=os.environ) -> list[str]:
    """Adds the flags not already in ``env["XLA_FLAGS"]``; returns those added."""
    current = env.get("XLA_FLAGS", "")
    have = {f.lstrip("-").split("=", 1)[0] for f in current.split()}
    added = [f"--{k}={v}" for k, v in FLAGS.items() if k not in have]
    if not added:
        return []
    started = bool(getattr(xla_bridge, "_backends", None))
    if started:
        warnings.warn(f"JAX's backends already exist, so XLA will not see {added}: import moejax before running "
                      "any JAX computation (or set them in XLA_FLAGS)", stacklevel=2)
        return []
    env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
