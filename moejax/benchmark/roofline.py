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


def time_device(fn, *args, reps: tuple[int, int] = (2, 10), iters: int = 5) -> float:
    """Seconds per call of ``fn`` on the device, host dispatch and synchronisation excluded: ``fn`` runs n
    times inside one program for two counts n, and the difference is divided by the difference of the
    counts (a wall-clock call of a small kernel is mostly launch latency: 200+ us for a 15 us MLA decode
    on the H100, BENCHMARKS.md 2026-12-07b). Each repetition's last integer argument (else the first) gets
    0 x the sum of the previous output added, so XLA can neither hoist nor merge the calls; that adds one
    read of the output a call, the same for every path."""
    idx = next((i for i in reversed(range(len(args))) if jnp.issubdtype(jnp.asarray(args[i]).dtype, jnp.integer)), 0)

    def looped(n):
        def loop(*a):
            def body(_, dep):
                out = fn(*a[:idx], dep, *a[idx + 1:])
                total = sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))
                return dep + (total * 0.0).astype(dep.dtype)
            return jax.lax.fori_loop(0, n, body, a[idx])
        return jax.jit(loop)

    lo, hi = reps
    t_lo = time_call(looped(lo), *args, iters=iters, reduce=min)
    t_hi = time_call(looped(hi), *args, iters=iters, reduce=min)
    return max(t_hi - t_lo, 1e-9) / (hi - lo)


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
