"""The two floors every benchmark reports: bytes over the measured copy bandwidth and
FLOPs over the measured bf16 matmul rate, measured on the device in the same run."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_call(fn, *args, iters: int = 10, warmup: int = 1, reduce=statistics.median) -> float:
    """Seconds per call of a jitted fn (compilation excluded): the median by default."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return reduce(ts)


def _best(fn, *args):
    return time_call(fn, *args, iters=5, reduce=min)


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"  # small probes there: a CPU has no floor worth minutes


def measure_copy_bandwidth(nbytes: int | None = None) -> float:
    """Bytes/s of an elementwise bf16 pass (read + write) over a buffer larger than any cache."""
    nbytes = nbytes or ((64 << 20) if _on_cpu() else (4 << 30))
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    return 2 * nbytes / _best(jax.jit(lambda a: a * 1.0001), x)


def measure_matmul_rate(n: int | None = None) -> float:
    """bf16 FLOP/s of an n x n x n matmul with f32 accumulation."""
    n = n or (512 if _on_cpu() else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    return 2 * n ** 3 / _best(jax.jit(lambda p: jnp.dot(p, p, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), a)
