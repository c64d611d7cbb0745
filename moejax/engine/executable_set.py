"""The runner's precompiled set through the executable cache (moejax/executable_cache.py): what each
program's key holds, the whole set loaded from its manifest without tracing, and one program loaded
or stored as precompile builds it.

What a program depends on (its key, beside the environment's): a model step (decode, the prefills, a
proposer's programs) the whole engine configuration (model, kernels, cache, scheduler, layout); the
sampler the vocabulary, the largest decode batch (its padded feed) and the dtype; the decode input
gather the largest decode batch; the cache-row export/import the cache's shape and dtype. Each also
holds its label (the bucket) and the number of ranks. So a setting that changes only the model steps
(e.g. max_model_len's block-table widths) leaves the sampler's executables loaded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

from moejax.executable_cache import ExecutableCache, PrecompiledFunction, signature_from_json

log = logging.getLogger("moejax.precompile")
_STEP = None  # the family of every label not listed below: the whole configuration


def _family(label: str) -> str | None:
    head = label.split()[0]
    return head if head in ("sample", "feed", "export_rows", "import_rows") else _STEP


# Settings read by the host only (when to compile, where the weights come from, the scheduler's policies):
# no program changes with them, so they are not in any key. kv_role picks which export/import programs
# the set has, never what one computes: it is in the set's key (set_depends) only.
HOST_ONLY_SETTINGS = frozenset({"precompile", "print_programs", "executable_cache_dir", "compilation_cache_dir",
                                "load_format", "max_preemptions", "kv_role",
                                "scheduling_policy", "enable_prefix_caching", "async_scheduling"})


def _stable(v):
    """``v`` as JSON the same in every process (a set's repr follows the string hash seed)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"type": type(v).__name__, **{f.name: _stable(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, (set, frozenset)):
        return sorted((_stable(x) for x in v), key=repr)
    if isinstance(v, (list, tuple)):
        return [_stable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _stable(x) for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))}
    return v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)


def config_key(config) -> dict:
    """The engine configuration as a model step's key: every view but the scheduler's (its shapes are
    settings), and every setting but the host's."""
    out = {f.name: _stable(getattr(config, f.name)) for f in dataclasses.fields(config)
           if f.name not in ("args", "scheduler")}
    out["settings"] = {f.name: _stable(getattr(config.args, f.name)) for f in dataclasses.fields(config.args)
                       if f.name not in HOST_ONLY_SETTINGS}
    return out


def program_depends(runner, label: str) -> dict:
    base = {"label": label, "ranks": runner.num_ranks}
    family = _family(label)
    if family == "sample":
        return {**base, "vocab": runner.cfg.vocab_size, "max_decode_batch": runner.buckets.max_decode_batch,
                "dtype": str(runner.config.dtype)}
    if family == "feed":
        return {**base, "max_decode_batch": runner.buckets.max_decode_batch}
    if family in ("export_rows", "import_rows"):
        return {**base, "cache": [list(runner.cache.shape), str(runner.cache.dtype)]}
    return {**base, "config": config_key(runner.config)}


def set_depends(runner) -> dict:
    """The manifest's key: the whole configuration (any change may change the set itself)."""
    return {"ranks": runner.num_ranks, "config": config_key(runner.config), "kv_role": runner.config.args.kv_role}


def functions(runner) -> dict[str, PrecompiledFunction]:
    return {v.name: v for v in vars(runner).values() if isinstance(v, PrecompiledFunction)}


def manifest_of(runner, cache: ExecutableCache) -> list[dict]:
    """The set's manifest as kept (its labels, functions and signatures), [] if there is none current."""
    return cache.load_manifest(set_depends(runner)) or []


def load_set(runner, cache: ExecutableCache, threads: int = 1) -> int:
    """Installs every executable of the set's manifest (no trace); returns how many, 0 if the set is not
    complete on disk (then precompile builds what is missing, loading the rest program by program).
    ``threads`` entries load at once: a model step's executable takes about a second to read and load on
    the H100 (BENCHMARKS.md, 2026-12-07d), nearly all of a cached restart when done one by one."""
    manifest = cache.load_manifest(set_depends(runner))
    if manifest is None:
        return 0
    fns = functions(runner)
    done, missed = [0], threading.Event()

    def one(entry):
        if missed.is_set():  # the set is incomplete: precompile loads or builds program by program
            return None
        fn = fns.get(entry["fn"])
        t = time.perf_counter()
        got = cache.load(entry["label"], program_depends(runner, entry["label"])) if fn is not None else None
        if got is None or got[1] != signature_from_json(entry["signature"]):
            missed.set()
            return None
        done[0] += 1  # the count in the log line only
        log.info("loaded %s in %.2f s (%d/%d)", entry["label"], time.perf_counter() - t, done[0], len(manifest))
        return fn, got

    with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="moejax-load") as pool:
        loaded = list(pool.map(one, manifest))
    if missed.is_set():
        return 0
    for fn, (compiled, sig) in loaded:
        fn.install(sig, compiled)
    return len(loaded)


def load_program(runner, cache: ExecutableCache, program) -> bool:
    """Installs ``program``'s executable from the cache if its entry is current; False: build it."""
    if not isinstance(program.fn, PrecompiledFunction):
        return False
    got = cache.load(program.label, program_depends(runner, program.label))
    if got is None or got[1] != program.fn.signature(program.args):
        return False
    program.fn.install(*reversed(got))
    return True


def store_program(runner, cache: ExecutableCache, program, compiled) -> None:
    """Installs ``compiled`` for ``program`` and keeps it (programs of an unwrapped jit are not kept)."""
    if isinstance(program.fn, PrecompiledFunction):
        sig = program.fn.signature(program.args)
        program.fn.install(sig, compiled)
        cache.store(program.label, program_depends(runner, program.label), compiled, sig)


def store_manifest(runner, cache: ExecutableCache, programs) -> None:
    """The set's labels, functions and signatures: written only when every program is kept."""
    if all(isinstance(p.fn, PrecompiledFunction) for p in programs):
        cache.store_manifest(set_depends(runner), [
            {"label": p.label, "fn": p.fn.name, "signature": list(p.fn.signature(p.args))} for p in programs])
