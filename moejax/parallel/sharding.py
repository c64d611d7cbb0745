"""The sharding rules, in one place.

One mesh axis, ``ep``, of N devices serves as both the data-parallel axis
(attention, norms, dense and shared-expert MLPs, the KV cache and the request
batch: each device has its own) and the expert-parallel axis (routed experts
split E/N per device).

| array                                  | global shape              | spec      |
|----------------------------------------|---------------------------|-----------|
| every dense weight, norms, router      | as in HF                  | P()       |
| routed experts gate/up/down            | [E, in, out]              | P("ep")   |
| expert placement (logical -> slot)     | [E]                       | P()       |
| KV cache                               | [N, L, slots, 576]        | P("ep")   |
| per-step batch inputs (tokens, tables) | [N, B_rank, ...]          | P("ep")   |
| sampled tokens / logprobs              | [N, B_rank]               | P("ep")   |
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.weights.hf_names import flatten, is_stacked_expert, unflatten

AXIS = "ep"


def make_mesh(num_ranks: int) -> Mesh:
    devices = jax.devices()
    if len(devices) < num_ranks:
        raise ValueError(f"parallel layout needs {num_ranks} devices, {len(devices)} available "
                         "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return Mesh(np.array(devices[:num_ranks]), (AXIS,))


def param_specs(params):
    return unflatten({path: P(AXIS) if is_stacked_expert(path) else P() for path in flatten(params)})


def shard_params(params, mesh: Mesh):
    specs = param_specs(params)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
