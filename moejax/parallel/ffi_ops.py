"""The dispatch and combine custom calls of the XLA FFI extension (ffi/, docs/ffi.md), one contract
for every implementation (ffi/ep_contract.h): call them per rank inside ``jax.shard_map`` over the
expert-parallel axis. Output shapes are static at the worst case (every token of every rank lands
on one rank: R*T rows), so nothing is dropped and a step stays one compiled program."""

from __future__ import annotations

import itertools
import os
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src import source_info_util  # JAX has no public reader of the name stack

from moejax.parallel import ffi_library
from moejax.parallel.ffi_library import COMBINE_TARGET, DISPATCH_TARGET

# How long a rank of the host implementation waits for its peers before failing with an error
# naming the missing ranks (a bound, never reached when XLA runs every device's program).
TIMEOUT_ENV = "MOEJAX_FFI_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
# With XLA's run id, the op id tells the host rendezvous which ranks' calls meet: one per call site.
_op_ids = itertools.count(1 << 32)  # above every scope hash


def _op_id(kind: str) -> int:
    """A hash of the call's name scope (a Flax module's path, e.g. ``...layers_3.ffn/mlp/experts``),
    so a program's HLO does not depend on the order this process traced its calls (the persistent
    compilation cache hits across processes); outside any named scope, a fresh counter value."""
    try:
        scope = str(source_info_util.current_name_stack())
    except (ImportError, AttributeError):
        scope = ""
    return zlib.crc32(f"{kind}:{scope}".encode()) if scope else next(_op_ids)


class Received(NamedTuple):
    """What dispatch delivers to one rank: rows [0, num_recv) hold the tokens routed here."""
    x: jax.Array  # [R*T, H], the tokens' dtype (FP8 included)
    ids: jax.Array  # [R*T, k] int32: local expert index of each choice on this rank, -1 elsewhere
    weights: jax.Array  # [R*T, k] float32, 0 where ids is -1
    scales: jax.Array  # [R*T, S] float32 (S = 0 without scales)
    src: jax.Array  # [R*T] int32: source rank * T + source token, -1 past num_recv
    expert_counts: jax.Array  # [E] int32: (token, expert) pairs per local expert
    num_recv: jax.Array  # [] int32


def _timeout_ms(timeout_s: float | None) -> int:
    return int(1000 * (timeout_s if timeout_s is not None else float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))))


def dispatch(x, slots, weights, rank, *, n_ranks: int, experts_per_rank: int, scales=None,
             timeout_s: float | None = None) -> Received:
    """x [T, H]; slots [T, k] physical expert slots (-1: not sent, e.g. padding); weights [T, k];
    rank: this rank's index on the axis; scales [T, S] (FP8 block scales), carried with their tokens."""
    ffi_library.require()  # the platform's implementation registered, or an error naming what is missing
    T, H = x.shape
    k = slots.shape[1]
    cap = n_ranks * T
    scales = jnp.zeros((T, 0), jnp.float32) if scales is None else scales.astype(jnp.float32)
    S = scales.shape[1]
    i32, f32 = jnp.int32, jnp.float32
    out = [jax.ShapeDtypeStruct((cap, H), x.dtype), jax.ShapeDtypeStruct((cap, k), i32),
           jax.ShapeDtypeStruct((cap, k), f32), jax.ShapeDtypeStruct((cap, S), f32),
           jax.ShapeDtypeStruct((cap,), i32), jax.ShapeDtypeStruct((experts_per_rank,), i32),
           jax.ShapeDtypeStruct((), i32)]
    call = jax.ffi.ffi_call(DISPATCH_TARGET, out)
    res = call(x, slots.astype(i32), weights.astype(f32), scales, jnp.asarray(rank, i32),
               n_ranks=n_ranks, experts_per_rank=experts_per_rank, op_id=_op_id("dispatch"),
               timeout_ms=_timeout_ms(timeout_s))
    return Received(*res)


def combine(y, src, rank, *, n_ranks: int, timeout_s: float | None = None):
    """y [R*T, H]: each received row's output (routing weights applied, local experts summed);
    src: dispatch's ``Received.src``. Returns float32 [T, H]: per own token, the sum of its rows
    from every rank, added in rank order."""
    ffi_library.require()
    cap, H = y.shape
    call = jax.ffi.ffi_call(COMBINE_TARGET, jax.ShapeDtypeStruct((cap // n_ranks, H), jnp.float32))
    return call(y, src.astype(jnp.int32), jnp.asarray(rank, jnp.int32), n_ranks=n_ranks, op_id=_op_id("combine"),
                timeout_ms=_timeout_ms(timeout_s))
