"""Timing of the expert-parallel exchange alone: one MoE layer's dispatch + combine over a mesh,
and a plain all_to_all of the same size as the rate it is compared with (scripts/bench_ep.py,
scripts/bench_decode.py --components)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.benchmark.roofline import time_call
from moejax.layers.experts import ExpertWeights
from moejax.parallel.dispatch import dispatch_fn
from moejax.parallel.sharding import AXIS

PROBE_WIDTH = 16  # the expert MLP's intermediate size while timing the exchange: its compute is negligible


def all_to_all_rate(mesh, nbytes_per_rank: int, iters: int = 20) -> float:
    """Bytes one rank sends to the others per second, measured with a plain tiled all_to_all."""
    n = mesh.size
    rows = max(n, nbytes_per_rank // 2 // 1024 // n * n)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n * rows, 1024), jnp.bfloat16),
                       NamedSharding(mesh, P(AXIS)))
    f = jax.jit(jax.shard_map(lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True), mesh=mesh,
                              in_specs=P(AXIS), out_specs=P(AXIS)))
    return rows * 1024 * 2 * (n - 1) / n / time_call(f, x, iters=iters)


def time_dispatch(mesh, backend: str, tokens: int, hidden: int, experts: int, top_k: int, seed: int = 0,
                  iters: int = 20) -> tuple[float, float]:
    """(seconds, bytes each rank moves off-device) of one MoE layer's dispatch + combine with
    ``backend`` for ``tokens`` per rank, uniform random routing, contiguous placement."""
    n = mesh.size
    T, H, E, k, I = tokens, hidden, experts, top_k, PROBE_WIDTH
    key = jax.random.split(jax.random.key(seed), 6)
    shard = NamedSharding(mesh, P(AXIS))
    x = jax.device_put(jax.random.normal(key[0], (n * T, H), jnp.bfloat16), shard)
    idx = jnp.argsort(jax.random.uniform(key[1], (n * T, E)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.device_put(jax.nn.softmax(jax.random.normal(key[2], (n * T, k)), axis=-1), shard)
    valid = jax.device_put(jnp.ones((n * T,), bool), shard)
    slots, replicas = jnp.arange(E, dtype=jnp.int32)[:, None], jnp.ones((E,), jnp.int32)
    wg = jax.device_put((0.02 * jax.random.normal(key[3], (E, H, I))).astype(jnp.bfloat16), shard)
    wu = jax.device_put((0.02 * jax.random.normal(key[4], (E, H, I))).astype(jnp.bfloat16), shard)
    wd = jax.device_put((0.02 * jax.random.normal(key[5], (E, I, H))).astype(jnp.bfloat16), shard)
    # Off-device bytes per rank: a2a ships [ranks, T, H] buffers (static worst case) both ways;
    # ragged and ffi ship the (token, rank) pairs that exist; replicated all-gathers x and reduce-scatters
    # float32 partial sums.
    dest = np.asarray(idx).reshape(n, T, k) // (E // n)
    pairs = float(np.mean([sum(len(set(dest[r, t]) - {r}) for t in range(T)) for r in range(n)]))
    moved = {"a2a": 2 * (n - 1) * T * H * 2, "ragged": 2 * pairs * H * 2, "ffi": 2 * pairs * H * 2,
             "replicated": (n - 1) * T * H * 2 + (n - 1) * T * H * 4}[backend]
    body = functools.partial(dispatch_fn(backend), axis=AXIS, n_ranks=n)
    f = jax.jit(jax.shard_map(lambda *a: body(*a[:6], ExpertWeights(*a[6:]))[0], mesh=mesh,
                              in_specs=(P(AXIS),) * 4 + (P(), P()) + (P(AXIS),) * 3, out_specs=P(AXIS),
                              check_vma=False))
    idx = jax.device_put(idx, shard)
    return time_call(f, x, idx, w, valid, slots, replicas, wg, wu, wd, iters=iters), moved
