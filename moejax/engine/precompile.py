"""Start-up compilation of the runner's precompiled set (ModelRunner.precompile_programs), so that no
request compiles anything: each program loaded from the executable cache (moejax/executable_cache.py,
engine/executable_set.py) where its entry is current, else traced here and compiled by XLA in
``threads`` threads (``default_threads``; tracing, which holds Python, overlaps the compiles, on CPU too, with
``lowering_threads`` of them at work until it is done); one log line a
program ("compiled LABEL in S s (i/n)" / "loaded ...": scripts/bench_startup.py reads them), one line
for the cache's hits and misses, and with ``print_programs`` the whole set with why each program exists.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time

from tqdm.auto import tqdm

from moejax import compilation
from moejax.engine import executable_set
from moejax.executable_cache import ExecutableCache

log = logging.getLogger("moejax.precompile")

# Why a program of each family exists (the bucket is in its label: moejax/engine/buckets.py's rules).
WHY = {
    "decode": "a decode step of up to B sequences a rank whose block tables fit W blocks",
    "prefill": "a prefill of whole prompts packed in one stream of up to T tokens, up to B prompts a rank",
    "prefill_paged": "a chunked or prefix-cached prefill: up to B chunks of up to S tokens after a cached context",
    "sample": "the sampler of the steps whose logits have this many rows, in this sampling mode (layers/sampler.py)",
    "feed": "the decode input gather of a B-sequence step fed by the step in flight (async scheduling)",
    "export_rows": "a disaggregated handoff's export of up to P cache rows (kv_role prefill or both: "
                   "engine/kv_handoff.py)",
    "import_rows": "a disaggregated handoff's import of up to P cache rows (kv_role decode or both: "
                   "engine/kv_handoff.py)",
    "sample history-load": "the sampling controls' history rows rebuilt for sequences that start using "
                           "penalties (engine/sample_controls.py)",
}


def default_threads() -> int:
    """Compile threads: $MOEJAX_COMPILE_THREADS, else the CPU count (at most 8: a program takes seconds to
    minutes on a GPU). While programs are still being traced, ``lowering_threads`` of them compile."""
    env = os.environ.get("MOEJAX_COMPILE_THREADS")
    if env:
        return int(env)
    return min(8, os.cpu_count() or 1)


def lowering_threads(threads: int) -> int:
    """Compile threads at work while the calling thread still traces and lowers programs: one core left to
    it (on a 2-core CPU one compile beside the tracing, both cores compiling once it is done: a second
    compile beside the tracing thread made every build ~2x slower there, BENCHMARKS.md 2026-12-07b and
    2026-12-07f start-up (CPU))."""
    return max(1, min(threads, (os.cpu_count() or 1) - 1))


def describe(labels: list[str]) -> list[str]:
    """One line a program: its label (family and bucket) and why it exists; a sampler's line names the
    steps whose logits it samples."""
    rows_of = {}
    for lb in labels:
        b = re.search(r"\bB=(\d+)", lb)
        if lb.split()[0] in ("decode", "prefill", "prefill_paged") and b:
            rows_of.setdefault(int(b.group(1)), []).append(lb)
    out = []
    for i, lb in enumerate(labels, 1):
        family = lb.split()[0]
        why = WHY.get(lb, WHY.get(family, "a program of the speculative proposer (engine/proposer.py)"))
        if family == "sample" and "rows=" in lb:
            rows = int(re.search(r"rows=(\d+)", lb).group(1))
            steps = rows_of.get(rows) or ["a speculative verify"]
            why += f"; rows of: {', '.join(steps[:4])}{f' and {len(steps) - 4} more' if len(steps) > 4 else ''}"
        out.append(f"{i:4d}  {lb:<72s} {why}")
    return out


def build(runner, progress: bool = True, threads: int | None = None) -> dict:
    """Loads or compiles every program of ``runner.precompile_programs()`` and installs it; returns
    {"programs", "seconds"} and, if the whole set came from the executable cache, "loaded"."""
    t0 = time.perf_counter()
    threads = max(1, threads or default_threads())  # 0 or less: one worker, as inline builds were
    cache = ExecutableCache.open(runner.config.args.executable_cache_dir)
    if cache is not None and compilation.exclusive_of_executable_cache():
        log.info("JAX's persistent compilation cache is off in this process: its executables could not be kept "
                 "by the executable cache here (moejax/compilation.py keeps_object_code)")
    show = runner.config.args.print_programs
    if cache is not None and (n := executable_set.load_set(runner, cache, threads)):  # the whole set: nothing traced
        if show:
            print("\n".join(describe([e["label"] for e in executable_set.manifest_of(runner, cache)])), flush=True)
        log.info("executable cache %s: all %d programs loaded, none traced or compiled", cache.dir, n)
        return {"programs": n, "seconds": time.perf_counter() - t0, "loaded": n}
    programs = runner.precompile_programs()
    if show:
        print("\n".join(describe([p.label for p in programs])), flush=True)
    total = len(programs)
    bar = tqdm(total=total, desc="Compiling programs", unit="prog", disable=not progress)
    done = [0]

    # The executable cache's writes (serialize, check, write: ~0.04 s a model step on CPU) in a thread of their
    # own, off the compile worker, which is start-up's critical path on CPU (BENCHMARKS.md 2026-12-07f start-up
    # (CPU)); every one is done (its program installed) before build returns.
    storer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moejax-store") if cache is not None else None
    stores = []

    gate = threading.Semaphore(lowering_threads(threads))  # the compile workers allowed to run now

    def compile_one(program, lowered):
        with gate:
            t = time.perf_counter()
            compiled = lowered.compile()
        done[0] += 1
        log.info("compiled %s in %.2f s (%d/%d)", program.label, time.perf_counter() - t, done[0], total)
        if storer is not None:
            stores.append(storer.submit(executable_set.store_program, runner, cache, program, compiled))
        bar.update(1)
        return compiled

    def loaded(p) -> bool:
        if cache is None or not executable_set.load_program(runner, cache, p):
            return False
        done[0] += 1
        bar.update(1)
        return True

    # Traced and lowered here, compiled in the pool: Python's tracing of the next programs runs beside XLA's
    # builds (BENCHMARKS.md 2026-12-07e start-up (CPU)); once every program is lowered, all the pool's workers
    # compile.
    def lower(program):  # timed apart from the build: on a GPU whichever of the two is start-up's bound
        t = time.perf_counter()
        lowered = program.lower()
        log.info("lowered %s in %.2f s", program.label, time.perf_counter() - t)
        return lowered

    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="moejax-compile") as pool:
        futures = [pool.submit(compile_one, p, lower(p)) for p in programs if not loaded(p)]
        for _ in range(threads - lowering_threads(threads)):
            gate.release()
        for f in futures:
            f.result()
    bar.close()
    if storer is not None:
        storer.shutdown()
        for f in stores:
            f.result()
    if cache is not None:
        executable_set.store_manifest(runner, cache, programs)
        log.info("executable cache %s: %s", cache.dir, cache.summary())
    return {"programs": total, "seconds": time.perf_counter() - t0}
