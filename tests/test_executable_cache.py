"""The executable cache (moejax/executable_cache.py, engine/executable_set.py): a restart on the kept
executables traces and compiles nothing and serves the same tokens; a changed key rebuilds what depends
on it (and only that); a truncated or foreign entry is rebuilt with a warning, never run; a CPU executable
whose serialized form lacks its code (one JAX's persistent cache handed back) is never kept or run."""

import glob
import logging
import os
import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import serialize_executable

import moejax
from moejax import compilation, executable_cache, executable_check
from moejax.engine import executable_set
from moejax.engine.sampling_params import SamplingParams
from tests import test_precompile
from tests.test_precompile import tiny_path  # noqa: F401 - the fixture
from conftest import SMALL_ENGINE as KW, random_v3_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_v3_tiny(tmp_path_factory, "ec")


@pytest.fixture(scope="module")
def cold(ckpt, tmp_path_factory):
    """One cold start into a module folder: (folder, precompile's result, traces, builds, tokens served);
    each test starts from a copy of it (a cold start is most of this file's time)."""
    d = str(tmp_path_factory.mktemp("cold") / "executables")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(executable_cache.ENV_VAR, d)
        model, out, traces, builds = start(ckpt)
        return d, out, traces, builds, serve(model, PROMPTS)


@pytest.fixture
def cache_dir(cold, tmp_path, monkeypatch):
    """A copy of the cold start's folder, the engines' executable cache."""
    d = str(tmp_path / "executables")
    shutil.copytree(cold[0], d)
    monkeypatch.setenv(executable_cache.ENV_VAR, d)
    return d


def start(ckpt, **kw):
    """A precompiled model; (model, precompile's result, traces, builds) of its start-up."""
    model = moejax.load(ckpt, **{**KW, **kw})
    model.engine  # the runner (its cache's zeros built here, not by precompile)
    built = compilation.COUNTER.snapshot()[0]
    out = model.engine.precompile(progress=False)
    return model, out, sum(model.engine.runner.trace_counts.values()), compilation.COUNTER.snapshot()[0] - built


# Greedy, seeded sampling with top-k, and top logprobs: three sampler modes (each its own executable).
PARAMS = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=11), dict(temperature=0.0, top_logprobs=3)]
PROMPTS = [[5, 9, 17, 3], [101, 7], [42, 43, 44]]


def serve(model, prompts):
    """Each prompt's tokens and logprobs, the prompts run together (one batch a step)."""
    eng = model.engine
    seqs = [eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=True, **kw))
            for p, kw in zip(prompts, PARAMS)]
    while eng.has_unfinished():
        eng.step()
    return [(list(s.output_ids), [round(float(x), 6) for x in s.logprobs]) for s in seqs]


@pytest.mark.parametrize("threads", ["1", "3"])  # entries loaded one by one, and in a pool of three
def test_restart_traces_and_compiles_nothing_and_serves_the_same_tokens(ckpt, cold, cache_dir, threads, monkeypatch):
    monkeypatch.setenv("MOEJAX_COMPILE_THREADS", threads)
    _, out, traces, builds, want = cold
    assert "loaded" not in out and traces > 0 and builds == out["programs"]
    warm, out2, traces2, builds2 = start(ckpt)
    assert out2["loaded"] == out["programs"] and traces2 == 0 and builds2 == 0
    built = compilation.COUNTER.snapshot()[0]
    assert serve(warm, PROMPTS) == want
    assert sum(warm.engine.runner.trace_counts.values()) == 0  # serving ran the loaded executables only
    assert compilation.COUNTER.snapshot()[0] == built


def test_a_changed_key_rebuilds_what_depends_on_it(ckpt, cold, cache_dir, caplog):
    out = cold[1]
    sample = sum(1 for f in glob.glob(os.path.join(cache_dir, "*.exe")))
    assert sample == out["programs"] + 1  # and the manifest
    # max_model_len changes the model steps' block tables and the cache's rows, not the sampler or the gather.
    with caplog.at_level(logging.INFO, logger="moejax.precompile"):
        model, out2, _, builds = start(ckpt, max_model_len=32)
    programs = model.engine.runner.precompile_programs()
    kept = [p.label for p in programs if p.label.split()[0] in ("sample", "feed")]
    assert "loaded" not in out2 and builds == len(programs) - len(kept) > 0
    assert any("rebuilding decode" in r.message and "config" in r.message for r in caplog.records)
    assert not any(f"rebuilding {lb}:" in r.message for lb in kept for r in caplog.records)
    # The start-up line: hits, misses and why rebuilt.
    summary = [r.message for r in caplog.records if r.message.startswith("executable cache ")]
    assert summary and f"{len(kept)} loaded, {builds} built" in summary[-1] and "with a changed key: " in summary[-1]


def test_a_changed_kv_role_builds_only_its_handoff_programs(ckpt, cold, cache_dir):
    """kv_role changes the set (its export/import programs: model_runner._row_programs), not any program in
    it: a prefill side started on a plain server's cache loads every program but its one export (one rows
    bucket at max_model_len 16), then restarts on its own manifest."""
    out = cold[1]
    model, out2, _, builds = start(ckpt, kv_role="prefill")
    assert "loaded" not in out2 and out2["programs"] == out["programs"] + 1 and builds == 1
    assert model.engine.runner.trace_counts["export_rows"] == 1
    _, out3, traces3, builds3 = start(ckpt, kv_role="prefill")
    assert out3["loaded"] == out2["programs"] and traces3 == builds3 == 0


def test_a_truncated_or_foreign_entry_is_rebuilt_with_a_warning(ckpt, cold, cache_dir, caplog):
    out = cold[1]
    files = sorted(glob.glob(os.path.join(cache_dir, "*.exe")), key=os.path.getsize)
    big, other = files[-1], files[-2]
    with open(big, "rb") as f:
        blob = f.read()
    with open(big, "wb") as f:
        f.write(blob[:len(blob) // 2])
    with open(other, "rb") as f:
        foreign = f.read()
    with open(files[-3], "wb") as f:
        f.write(foreign)  # another program's entry under this one's name
    with caplog.at_level(logging.WARNING, logger="moejax.precompile"):
        model, out2, _, builds = start(ckpt)
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("truncated" in w for w in warnings) and any("foreign entry" in w for w in warnings)
    assert "loaded" not in out2 and builds == 2  # exactly the two bad entries
    assert serve(model, PROMPTS) == cold[4]  # and it serves the same tokens
    # Rebuilt entries are whole again: the next start loads everything.
    _, out3, traces3, builds3 = start(ckpt)
    assert out3["loaded"] == out["programs"] and traces3 == builds3 == 0


def test_environment_change_names_the_field(tmp_path, caplog, monkeypatch):
    cache = executable_cache.ExecutableCache(str(tmp_path))
    cache._write("x", {"a": 1}, b"payload")
    monkeypatch.setitem(cache.env, "jaxlib", "0.0.1")
    with caplog.at_level(logging.INFO, logger="moejax.precompile"):
        assert cache._read("x", {"a": 1}) is None
    assert any("jaxlib" in r.message and "-> 0.0.1" in r.message for r in caplog.records)
    assert cache._read("x", {"a": 2}) is None


def test_mixed_workload_after_a_cached_restart_compiles_nothing(tiny_path, monkeypatch, tmp_path):
    """test_precompile's mixed workload (streams, sampling modes, chunked prefills, prefix hits, the
    cache-row handoff), served by a server whose whole set came from the executable cache."""
    monkeypatch.setenv(executable_cache.ENV_VAR, str(tmp_path / "executables"))
    moejax.load(tiny_path, **{**test_precompile.HANDOFF, "precompile": True})  # the cold start fills the cache
    loaded = []
    real = executable_set.load_set
    monkeypatch.setattr(executable_set, "load_set", lambda *a: loaded.append(real(*a)) or loaded[-1])
    test_precompile.test_precompiled_server_and_handoff_never_compile(tiny_path)
    assert loaded and loaded[0] > 0  # the server's start loaded the set


def _f(x, y):
    return jnp.tanh(x) * 3 + y.sum(), jnp.sort(y)


def _compiled_via_jax_cache(tmp_path, x, y):
    """``_f`` compiled fresh, then handed back by JAX's persistent cache (a hit), with the process's
    compilation-cache state restored after."""
    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    try:
        compilation.enable_persistent_cache(str(tmp_path / "jax"))
        fresh = jax.jit(_f).lower(x, y).compile()
        jax.clear_caches()
        hits = compilation.COUNTER.cache_hits
        hit = jax.jit(_f).lower(x, y).compile()
        assert compilation.COUNTER.cache_hits == hits + 1
    finally:
        compilation.enable_persistent_cache(before[1] if before[0] and before[1] else "off")
    return fresh, hit


def _raw_fields(b: bytes) -> list[tuple[int, bytes, bytes]]:
    """A protobuf message's fields as (number, value, its encoding as found)."""
    out, i = [], 0
    while i < len(b):
        start = i
        key, i = executable_check._varint(b, i)
        wire = key & 7
        if wire == 2:
            n, i = executable_check._varint(b, i)
            value, i = b[i:i + n], i + n
        elif wire == 0:
            _, i = executable_check._varint(b, i)
            value = b""
        else:
            i += 8 if wire == 1 else 4
            value = b""
        out.append((key >> 3, value, b[start:i]))
    return out


def _without_an_object_file(exe: bytes) -> bytes:
    """A serialized XLA:CPU executable with its last object file dropped from its CompilationResultProto (what
    a lost part leaves), re-encoded."""
    n, i = executable_check._varint(exe, 0)
    outer = _raw_fields(exe[i + n:])
    inner = _raw_fields(next(v for f, v, _ in outer if f == 1))
    last = max(k for k, (f, _, _) in enumerate(inner) if f == 8)
    result = b"".join(raw for k, (_, _, raw) in enumerate(inner) if k != last)
    head = bytes([(1 << 3) | 2]) + _varint(len(result))
    return exe[:i + n] + b"".join(head + result if f == 1 else raw for f, _, raw in outer)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_a_cpu_executable_without_its_code_is_never_kept_or_run(tmp_path, caplog):
    """The bug behind 'Function broadcast.NN_kernel not found': an executable JAX's persistent cache handed back
    serializes without its object code; loaded, it fails at run time. The cache refuses it with a warning
    (and an entry of it on disk is rebuilt, never run); a freshly compiled one is kept and runs."""
    rng = np.random.default_rng()
    x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((64,)).astype(np.float32)
    want = (np.tanh(x.astype(np.float64)) * 3 + y.astype(np.float64).sum(), np.sort(y))
    fresh, hit = _compiled_via_jax_cache(tmp_path, x, y)
    broken = serialize_executable.serialize(hit)
    assert executable_check.cpu_problem(broken[0]) is not None
    with pytest.raises(Exception, match="not found"):  # what such an entry did once loaded
        serialize_executable.deserialize_and_load(*broken, execution_devices=jax.devices()[:1])(x, y)
    whole = serialize_executable.serialize(fresh)[0]
    assert executable_check.cpu_problem(whole) is None
    exe = executable_check.serialized_executables(whole)[0]
    assert executable_check.missing_functions(exe) == [] and executable_check.missing_functions(_without_an_object_file(exe))

    cache = executable_cache.ExecutableCache(str(tmp_path / "ex"))
    sig = executable_cache.signature((x, y))
    with caplog.at_level(logging.WARNING, logger="moejax.precompile"):
        assert not cache.store("f", {}, hit, sig)
    assert any("not keeping f" in r.message for r in caplog.records) and cache.refused == 1
    assert not glob.glob(os.path.join(cache.dir, "*.exe"))
    # An entry of it written by an older moejax (no check on store) is rebuilt, never run.
    cache._write("f", {}, pickle.dumps(broken), signature=list(sig), devices=[jax.devices()[0].id])
    with caplog.at_level(logging.WARNING, logger="moejax.precompile"):
        assert cache.load("f", {}) is None
    assert any("unsafe to run" in r.message for r in caplog.records)
    assert cache.store("f", {}, fresh, sig)
    compiled, got_sig = cache.load("f", {})
    assert got_sig == sig
    out = compiled(x, y)
    np.testing.assert_allclose(np.asarray(out[0], np.float64), want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[1]), want[1])


def test_on_by_default_for_the_server_in_the_users_cache_folder(tmp_path, monkeypatch):
    from moejax.engine_args import EngineArgs
    from moejax.server.cli import build_load_kwargs, build_parser

    monkeypatch.delenv(executable_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    kw = build_load_kwargs(build_parser().parse_args([]))
    assert executable_cache.resolve_dir(kw["executable_cache_dir"]) == str(tmp_path / "xdg" / "moejax" / "executables")
    assert executable_cache.resolve_dir(build_load_kwargs(build_parser().parse_args(
        ["--executable-cache-dir", "off"]))["executable_cache_dir"]) is None
    assert executable_cache.resolve_dir(EngineArgs().executable_cache_dir) is None  # a library load: off
    monkeypatch.setenv(executable_cache.ENV_VAR, str(tmp_path / "moved"))  # the environment moves it, both ways
    assert executable_cache.resolve_dir("auto") == executable_cache.resolve_dir("env") == str(tmp_path / "moved")
