"""The sharding rules, in one place: every PartitionSpec is derived from ``RULES``.

One mesh axis, ``ep``, of N devices serves as both the data-parallel axis (attention,
norms, dense and shared-expert MLPs, the KV cache and the request batch: each device
has its own) and the expert-parallel axis (routed experts split E/N per device).
Arrays are described by logical axes; ``RULES`` maps the logical axes that are split
to mesh axes, and every other axis is replicated:

| array                                  | global shape              | logical axes      | spec      |
|----------------------------------------|---------------------------|-------------------|-----------|
| every dense weight, norms, router      | as in HF                  | (none split)      | P()       |
| routed experts gate/up/down (+ scales) | [E, in, out]              | ("expert", ...)   | P("ep")   |
| expert placement (logical -> slot)     | [E]                       | (none split)      | P()       |
| KV cache                               | [N, L, slots, row]        | ("rank", ...)     | P("ep")   |
| per-step batch inputs (tokens, tables) | [N, B_rank, ...]          | ("rank", ...)     | P("ep")   |
| sampled tokens / logprobs              | [N, B_rank]               | ("rank", ...)     | P("ep")   |
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.weights.param_tree import flatten, is_stacked_expert, unflatten

AXIS = "ep"

# Logical axis -> mesh axis. "rank": the leading per-device axis of the cache and of every
# per-step array (data parallel). "expert": the physical-slot axis of the routed experts.
RULES = {"rank": AXIS, "expert": AXIS}


def spec(*logical: str | None) -> P:
    """The PartitionSpec of an array with these logical axes (trailing axes replicated)."""
    return P(*(RULES.get(a) if a is not None else None for a in logical))


def param_logical_axes(path: tuple[str, ...]) -> tuple[str | None, ...]:
    """Routed experts (and anything else under ``mlp/experts``, e.g. their FP8 scales) are split
    along their leading slot axis; every other parameter is replicated."""
    return ("expert",) if is_stacked_expert(path) else ()


def param_specs(params):
    return unflatten({path: spec(*param_logical_axes(path)) for path in flatten(params)})


REPLICATED = spec()  # dense weights, expert placement tables
RANK = spec("rank")  # the cache and every per-step input/output
EXPERT = spec("expert")  # the routed experts' slot axis


def make_mesh(num_ranks: int) -> Mesh:
    """The ``ep`` mesh of num_ranks devices. Across several processes (moejax/parallel/processes.py)
    each process contributes the same number of its own devices, in process order, so rank r lives in
    process r // (num_ranks / processes)."""
    nproc = jax.process_count()
    if nproc == 1:
        devices = jax.devices()
        if len(devices) < num_ranks:
            raise ValueError(f"parallel layout needs {num_ranks} devices, {len(devices)} available "
                             "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        return Mesh(np.array(devices[:num_ranks]), (AXIS,))
    if num_ranks % nproc:
        raise ValueError(f"data_parallel_size {num_ranks} is not divisible by the {nproc} processes "
                         "(each process holds the same number of ranks)")
    per = num_ranks // nproc
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                  for p in range(nproc)]
    short = [p for p, ds in enumerate(by_process) if len(ds) < per]
    if short:
        raise ValueError(f"data_parallel_size {num_ranks} over {nproc} processes needs {per} devices in each; "
                         f"process {short[0]} has {len(by_process[short[0]])} (--devices-per-process of "
                         "python -m moejax.launch)")
    return Mesh(np.array([d for ds in by_process for d in ds[:per]]), (AXIS,))


def shard_params(params, mesh: Mesh):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, param_specs(params))


def put_replicated(tree, mesh: Mesh | None):
    """Host arrays onto every device of the mesh (or the default device without one). Across processes
    every process passes the same values and transfers them to its own devices."""
    if mesh is None:
        return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(mesh, REPLICATED))
