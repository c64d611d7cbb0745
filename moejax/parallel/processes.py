"""Several processes, one mesh: jax.distributed (multi-controller) set up from the environment.

``python -m moejax.launch`` (moejax/launch.py) starts one process per device group and gives each
these variables; ``initialize_from_env`` is the one place moejax calls ``jax.distributed.initialize``:

- ``MOEJAX_COORDINATOR``: host:port of process 0's coordination service (JAX's coordinator_address);
- ``MOEJAX_NUM_PROCESSES``, ``MOEJAX_PROCESS_ID``: JAX's num_processes and process_id;
- ``MOEJAX_HEARTBEAT_TIMEOUT_S`` (optional, default 30): JAX's heartbeat timeout. A process that stops
  heartbeating for that long makes JAX abort every other process: the backstop for a death moejax's
  own watch (moejax/parallel/peer_watch.py) did not handle first.

Without ``MOEJAX_NUM_PROCESSES`` (or with 1) nothing is initialised and moejax is one process.

Every process runs the same program (JAX's multi-controller model): the same ``moejax.load``, the
same ``moejax.generate`` calls with the same prompts, so every process builds the same host-side
step inputs (one schedule, computed identically everywhere: nothing in the engine depends on the
process). The HTTP server is the exception: only process 0 takes requests and it forwards each
step's engine calls to the others (moejax/engine/replicated.py).
"""

from __future__ import annotations

import hashlib
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

COORDINATOR_ENV = "MOEJAX_COORDINATOR"
NUM_PROCESSES_ENV = "MOEJAX_NUM_PROCESSES"
PROCESS_ID_ENV = "MOEJAX_PROCESS_ID"
HEARTBEAT_ENV = "MOEJAX_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 30
# How long a process exiting waits at JAX's shutdown barrier for the others (JAX's default is 300 s).
# Not the bound on a failure: a server whose peer died exits without the barrier (scripts/serve.py).
SHUTDOWN_TIMEOUT_S = 120


def _env_int(name: str, lo: int) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if n < lo:
        raise ValueError(f"{name} must be >= {lo}, got {n}")
    return n


def initialize_from_env() -> bool:
    """Joins the job described by the MOEJAX_* variables (idempotent); returns whether this is a
    multi-process job. Must run before anything touches a JAX device."""
    n = _env_int(NUM_PROCESSES_ENV, 1)
    if n is None or n == 1:
        return False
    if jax.distributed.is_initialized():
        return True
    pid = _env_int(PROCESS_ID_ENV, 0)
    if pid is None or pid >= n:
        raise ValueError(f"{PROCESS_ID_ENV} must be set to a process id in [0, {n}) when {NUM_PROCESSES_ENV}={n}, "
                         f"got {os.environ.get(PROCESS_ID_ENV)!r}")
    coordinator = os.environ.get(COORDINATOR_ENV)
    if not coordinator or ":" not in coordinator:
        raise ValueError(f"{COORDINATOR_ENV} must be host:port of process 0, got {coordinator!r}")
    heartbeat = _env_int(HEARTBEAT_ENV, 1) or DEFAULT_HEARTBEAT_S
    # CPU devices reach each other through gloo (the default CPU collectives cannot cross processes);
    # GPUs use NCCL/RCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM, which must stay the server's graceful stop.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(coordinator, num_processes=n, process_id=pid, heartbeat_timeout_seconds=heartbeat,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    return True


def count() -> int:
    return jax.process_count()


def index() -> int:
    return jax.process_index()


def is_leader() -> bool:
    """Process 0: the one that takes requests (the HTTP front end) in a multi-process server."""
    return jax.process_index() == 0


def to_host(tree):
    """NumPy copies of (possibly process-spanning) arrays, whole, in every process. Across processes
    this is a collective: every process must make the same call at the same point."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def barrier(name: str) -> None:
    """Every process waits here for the others (e.g. until process 0 has written a file they read)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def agree_min(n: int) -> int:
    """The smallest of every process's ``n`` (a size each computed from its own devices' memory)."""
    if jax.process_count() == 1:
        return n
    return int(np.asarray(multihost_utils.process_allgather(np.array([n], np.int64))).min())


def shared_seed() -> int | None:
    """A random seed, the same in every process (process 0's, broadcast); None in one process."""
    if jax.process_count() == 1:
        return None
    mine = np.frombuffer(os.urandom(4), np.uint32).astype(np.int64)
    return int(multihost_utils.broadcast_one_to_all(mine)[0])


def check_same(value, what: str) -> None:
    """Raises ValueError if ``value`` (anything with a deterministic repr: lists of ints, strings, ...)
    differs between processes: the engine's steps are collectives, so processes fed different inputs
    would compute garbage or hang. Compares a digest, so values of any size cost one small collective."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(repr(value).encode()).digest(), np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 8]
    if not (every == every[0]).all():
        differ = [i for i in range(len(every)) if not (every[i] == every[0]).all()]
        raise ValueError(f"{what} differ between processes (process 0 and {differ}): every process must make "
                         "the same call with the same arguments")
