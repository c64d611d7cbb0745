import os

# Tests run on the CPU; EP tests ask for 8 host devices. Set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Triton kernels run in Triton's interpreter here, chosen when triton.language is first imported (torch
# imports it too, so it is set before anything can); a GPU run of the Triton tests sets JAX_PLATFORMS.
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# LLVM at -O0: the tiny models' programs compile about 30% faster and run long enough anyway; the
# HLO and its fusions are XLA's usual ones, so what the tests compare is unchanged.
# XLA:CPU's legacy fusion emitters (``xla_cpu_use_fusion_emitters=false``): the same HLO and fusions, each
# fusion's loop emitted straight to LLVM IR instead of through the MLIR emitters, which halves the tiny
# models' compile time (v3-tiny's programs: 2.2 s -> 1.2 s, same tokens and logprobs bit for bit; the suite
# is compile-bound). Only on the jaxlib measured (0.10.x): XLA aborts on a flag it no longer knows.
_XLA_TEST_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
try:
    from importlib.metadata import version as _version

    if tuple(int(x) for x in _version("jaxlib").split(".")[:2]) == (0, 10):
        _XLA_TEST_FLAGS += " --xla_cpu_use_fusion_emitters=false"
except Exception:  # jaxlib not installed as a distribution, or an odd version string: the flags as they were
    pass
os.environ.setdefault("XLA_FLAGS", _XLA_TEST_FLAGS)
# The servers tests start (moejax serve keeps its executables by default) keep none, and nothing is written
# under the user's ~/.cache; tests/test_executable_cache.py points it at its own folders.
os.environ.setdefault("MOEJAX_EXECUTABLE_CACHE_DIR", "off")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# One persistent XLA compilation cache per test process, not shared (many tests compile the same tiny
# models' programs, which are then built once): set in JAX's config, not the environment, so the
# scripts tests start as subprocesses do not read entries this process writes (XLA:CPU's executable
# loading is fragile upstream: moejax/compilation.py).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    import jax

    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="moejax-test-xla-cache-"))

import contextlib  # noqa: E402
import random  # noqa: E402
import secrets  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from moejax.tiny.checkpoint import make_random_checkpoint  # noqa: E402
from moejax.tiny.presets import preset, with_layers  # noqa: E402

# Fresh random inputs every run, but replayable: every unseeded np.random.default_rng() draws
# from one seed per test (printed with a failure), and MOEJAX_TEST_SEED=<seed> replays it.
SEED_ENV = "MOEJAX_TEST_SEED"
_default_rng = np.random.default_rng
_state = {"seed": int(os.environ.get(SEED_ENV) or secrets.randbits(32))}
_state["seq"] = np.random.SeedSequence(_state["seed"])  # session fixtures draw from the session seed


def _seeded_default_rng(seed=None):
    return _default_rng(_state["seq"].spawn(1)[0] if seed is None else seed)


np.random.default_rng = _seeded_default_rng


def pytest_report_header(config):
    return f"moejax: session seed {_state['seed']} (replay with {SEED_ENV}={_state['seed']})"


@pytest.fixture(autouse=True)
def random_seed(request):
    """The seed of this test's unseeded generators; recorded on failure."""
    seed = int(os.environ.get(SEED_ENV) or secrets.randbits(32))
    _state["seq"] = np.random.SeedSequence(seed)
    random.seed(seed)
    request.node.moejax_seed = seed
    return seed


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs(request):
    """After each test module: drop its module-level model caches (``_MODELS``), JAX's compiled programs and
    the garbage. An XLA:CPU executable holds memory mappings; a worker that kept every module's programs
    passed 33k of the kernel's 65,530 (vm.max_map_count) and segfaulted in LLVM mapping the next one."""
    yield
    models = getattr(request.module, "_MODELS", None)
    if isinstance(models, dict):
        models.clear()
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


# Seconds each test file took in a full run (2026-12-06, two workers, setup + call + teardown), heaviest
# first. With --dist loadfile each worker takes the next file when it runs out of work; taking the long
# files first and leaving the short ones to fill in at the end evens the two workers out (xdist's own
# order, most tests first, left a 113 s file for last). Only an order: a file missing here runs after
# these, in collection order, and stale figures cost balance, never coverage.
FILE_SECONDS = {
    "test_speculative.py": 128, "test_fp8_model.py": 100, "test_expert_parallel.py": 80,
    "test_multiprocess.py": 72, "test_bench.py": 65, "test_engine.py": 62, "test_disaggregation.py": 55,
    "test_step3.py": 54, "test_kernels.py": 52, "test_dbo.py": 48, "test_precompile.py": 33,
    "test_prefill_attention.py": 32, "test_fp8_kernels.py": 31, "test_eplb.py": 30, "test_hf_parity.py": 30,
    "test_server.py": 28, "test_server_faults.py": 26, "test_triton_mla_decode.py": 26, "test_prefix_cache.py": 25,
    "test_mtp.py": 24, "test_disaggregated_server.py": 24, "test_loader.py": 23, "test_moe_fusion.py": 23,
    "test_packaging.py": 21, "test_scheduling_policy.py": 20, "test_ffi_dispatch.py": 20,
    "test_disaggregation_mesh.py": 17, "test_async_scheduling.py": 17, "test_layout.py": 11,
    "test_triton_fp8.py": 9, "test_qkv_a_merge.py": 9,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order the items come in
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Test files in FILE_SECONDS's order, heaviest first (a stable sort: each file's tests keep theirs)."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    seed = getattr(item, "moejax_seed", None)
    if rep.failed and seed is not None:
        rep.sections.append(("moejax seed", f"unseeded random inputs drew from seed {seed}; replay with\n"
                                            f"  {SEED_ENV}={seed} python -m pytest '{item.nodeid}'"))


# The small float32 engine that the executable-cache and precompile-list tests load: 16 tokens, two
# sequences, 8-token blocks and prefill steps, XLA's compilation cache off (what they count is moejax's).
SMALL_ENGINE = dict(dtype="float32", max_model_len=16, max_num_seqs=2, block_size=8, max_prefill_tokens=8,
                    progress=False, compilation_cache_dir="off")


def v3_tiny_two_layers(**overrides) -> dict:
    """v3-tiny (preset ``overrides``) at two layers, one dense and one MoE (both kinds still run): the model of
    the engine-level tests that compare the engine with a reference of the same model (sampling controls,
    n/best_of, echo, lm-eval, speculative). The suite is compile-bound and every step program unrolls each
    layer: the third layer (a second MoE one) cost tracing and compiling, and checked nothing the others do not."""
    return with_layers(preset("v3-tiny", **overrides), 2)


def random_v3_tiny(tmp_path_factory, name: str, **overrides) -> str:
    """A random v3-tiny checkpoint (preset ``overrides``, std 0.1) in a fresh folder from a fresh seed,
    printed for a replay."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"checkpoint seed {seed}")
    return make_random_checkpoint(str(tmp_path_factory.mktemp(name)), preset("v3-tiny", **overrides), seed=seed,
                                  std=0.1)


@contextlib.contextmanager
def serving(model, name: str, **load):
    """``model`` (a loaded model, or a checkpoint path loaded here in float32 with ``load``'s settings) served
    as ``name`` by a ServerThread on a free port (``.url``), stopped on the way out: the server of a module
    fixture (``with serving(path, NAME, max_model_len=128, max_num_seqs=8) as srv: yield srv``)."""
    import moejax
    from moejax.server.app import ServerThread
    if isinstance(model, str):
        model = moejax.load(model, dtype="float32", progress=False, **load)
    elif load:
        raise ValueError(f"serving: load settings {sorted(load)} given with a loaded model")
    srv = ServerThread(model, model_name=name).start()
    try:
        yield srv
    finally:
        srv.stop()


def openai_client(url: str, timeout: float = 120):
    """The openai client of the server at ``url``; no retries, so a failure shows as it happens."""
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def http_get(url: str, timeout: float = 30):
    """GET ``url``: (status, body), an HTTP error's status and body too (a 503 /health is an answer)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_healthy(proc, url: str, what: str, timeout: float = 180) -> None:
    """Until the server process ``proc`` at ``url`` answers /health 200; fails if it exits or takes longer."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            if http_get(url + "/health", timeout=10)[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.5)


def prefill_then_decode_logits(m, cache, lens, S: int, bs: int, nb: int, *, reverse_tables=False, last_only=False):
    """One jitted step of model ``m`` over the paged ``cache``: a prefill of len(lens) prompts of ``lens`` tokens
    (padded to S; the tokens from seed 0, the same at every call), then one decode step of each. Sequence b holds
    blocks nb*b .. nb*b + nb - 1 of bs slots (``reverse_tables``: in reverse order, non-contiguous pages); a
    padding token's slot is out of range (dropped). Returns (the prefill's logits, [B, S, V], or with
    ``last_only`` [B, V] of each last prompt token; the decode step's [B, V]), as jax arrays."""
    import jax
    import jax.numpy as jnp

    from moejax.layers.forward_batch import ForwardBatch
    vocab, num_slots = m.config.model.vocab_size, cache.shape[1]
    rng = np.random.default_rng(0)
    B = len(lens)
    tokens = np.zeros((B, S), np.int32)
    tables = np.arange(B * nb, dtype=np.int32).reshape(B, nb)
    if reverse_tables:
        tables = tables[:, ::-1].copy()
    slots = np.full((B, S), num_slots, np.int32)
    for b, n in enumerate(lens):
        tokens[b, :n] = rng.integers(2, vocab, n)
        slots[b, :n] = tables[b, np.arange(n) // bs] * bs + np.arange(n) % bs
    v = {"params": m.params, "routing": m.routing}
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))

    @jax.jit
    def step(cache):
        h, cache = m.module.apply(v, tokens, ForwardBatch.prefill(pos, jnp.asarray(lens, jnp.int32), slots), cache,
                                  method="prefill")
        pre = m.module.apply(v, h[jnp.arange(B), lens - 1] if last_only else h, method="logits")
        nxt = jnp.asarray(tokens[np.arange(B), lens - 1] + 1, jnp.int32) % vocab
        dslots = jnp.asarray(tables[np.arange(B), lens // bs] * bs + lens % bs, jnp.int32)
        h, cache = m.module.apply(v, nxt, ForwardBatch.decode(jnp.asarray(lens, jnp.int32), dslots, tables,
                                                      jnp.asarray(lens + 1, jnp.int32), bs), cache, method="decode")
        return pre, m.module.apply(v, h, method="logits")

    return step(cache)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def log_softmax(logits):
    """float64 log-softmax over the last axis: the reference for logprobs."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def assert_top_logprobs(top, ref_row, n, atol=1e-4):
    """``top``: the returned [(token id, logprob)] of one position; ``ref_row``: the reference log-softmax
    there. min(n, vocab) distinct ids, descending; each logprob that of its id; the values those of the
    reference's n best (compared as values: a near-tie may order two ids either way)."""
    ids = [int(i) for i, _ in top]
    lps = np.array([lp for _, lp in top], np.float64)
    k = min(n, ref_row.size)
    assert len(ids) == k and len(set(ids)) == k, (n, ids)
    assert np.all(np.diff(lps) <= 0), lps
    np.testing.assert_allclose(lps, ref_row[ids], atol=atol)
    np.testing.assert_allclose(lps, np.sort(ref_row)[::-1][:k], atol=atol)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """HF-written tiny checkpoints of both families, with their torch reference models."""
    from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
    out = {}
    # Initialiser std 0.1 spreads the logits so greedy near-ties are rare; the bf16
    # checks use HF's default 0.02, where bf16 rounding seldom flips a routing choice.
    for name, cfg in {
        "v3": preset("v3-tiny", initializer_range=0.1),
        "v2": preset("v2-lite-tiny", initializer_range=0.1),
        "v3-std": preset("v3-tiny"),
        "v2-std": preset("v2-lite-tiny"),
    }.items():
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, make_hf_checkpoint(d, cfg, seed=1))
    return out
