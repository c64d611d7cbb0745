"""Start-up compilation (issue 30): a server started with precompilation answers /health 503 "starting"
until every program is built, then serves a mixed workload (prompt lengths across buckets, chunked long
prompts, prefix hits, concurrency changes, sampling and logprob variants) with zero compiles; a second
process with the same persistent compilation cache loads every program and compiles none."""

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import moejax
from moejax import compilation
from moejax.engine.buckets import Buckets, token_bucket
from moejax.layers.sampler import SampleMode
from moejax.server.app import ServerThread, make_app
from moejax.server.metrics import parse_metrics
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

from conftest import http_get

# Small limits keep the program set small (~45 programs) and the test quick on CPU.
LOAD = dict(dtype="float32", max_model_len=96, max_num_seqs=4, max_prefill_tokens=32, progress=False,
            async_scheduling=True)
# The server of the handoff test below: one engine that exports and re-imports its own rows.
HANDOFF = dict(LOAD, kv_role="both")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=7, std=0.1)


def _complete(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("compile_bound", [False, True])
def test_buckets_cover_every_batch(compile_bound):
    """Every batch the runner can form maps to a shape in the precompiled set (or is split into ones that do)."""
    b = Buckets(max_num_seqs=48, max_prefill_tokens=200, max_blocks_per_seq=40, decode_width_scales=True,
                compile_bound=compile_bound)
    assert len(b.decode_widths) == (2 if compile_bound else 4)
    decode = set(b.decode_shapes())
    for n in range(1, 49):
        for blocks in range(1, 41):
            assert (b.decode_batch(n), b.decode_width(blocks)) in decode
    packed = set(b.packed_shapes())
    for tokens in range(1, 201):
        assert b.packed(tokens) in packed
        assert token_bucket(tokens) >= tokens
    paged = set(b.paged_shapes())
    rng = np.random.default_rng()
    for _ in range(200):
        chunks = [(int(rng.integers(0, 3)), int(rng.integers(1, 201))) for _ in range(int(rng.integers(1, 60)))]
        groups = b.split_paged(chunks)
        assert sorted(i for g in groups for i in g) == list(range(len(chunks)))
        for g in groups:
            S = b.paged_len(max(chunks[i][1] for i in g))
            per_rank = max(sum(chunks[i][0] == r for i in g) for r in range(3))
            assert (b.paged(per_rank, S), S) in paged and per_rank <= b.paged(per_rank, S)
    modes = b.sample_modes()
    assert len(modes) == (4 if compile_bound else 7)
    assert all(b.sample_mode(m) in modes for m in SampleMode.all())


def test_paged_chunks_stop_at_max_model_len():
    """A paged chunk is one sequence's tokens: no S past max_model_len's bucket, however many tokens a
    prefill step takes (a packed stream of several prompts still reaches max_prefill_tokens)."""
    b = Buckets(max_num_seqs=256, max_prefill_tokens=8192, max_blocks_per_seq=128, decode_width_scales=True,
                max_chunk=2048)
    assert max(S for _, S in b.paged_shapes()) == 2048 and b.max_tokens == 8192
    assert {(b.paged(1, S), S) for S in (16, 2048)} <= set(b.paged_shapes())
    assert b.wide_batch(2048) == 4  # as many 2048-token chunks as 8192 tokens hold
    coarse = Buckets(max_num_seqs=256, max_prefill_tokens=8192, max_blocks_per_seq=128, decode_width_scales=True,
                     max_chunk=2048, compile_bound=True)
    assert coarse.paged_lens == [16, 64, 256, 1024, 2048] and coarse.decode_widths == [32, 128]
    for n in range(1, 2049):
        assert n <= coarse.paged_len(n) <= max(16, 4 * n) and coarse.paged_len(n) in coarse.paged_lens


def test_precompiled_server_and_handoff_never_compile(tiny_path):
    """A server started with precompilation answers /health 503 "starting" until every program is built,
    then serves a mixed workload (prompt lengths across buckets, chunked long prompts, prefix hits,
    concurrency changes, sampling, logprob and penalty variants) with zero compiles. Then, on the same precompiled
    engine once the server has stopped (one start-up compilation for both checks): the disaggregated
    handoff (a prefilled sequence's rows exported, then imported into an engine; here the same engine
    exports and re-imports them: kv_role both) runs precompiled programs only."""
    from moejax.engine.kv_handoff import add_prefilled, take_prefilled
    from moejax.engine.sampling_params import SamplingParams
    model = moejax.load(tiny_path, **HANDOFF)
    app, aengine = make_app(model, "tiny", precompile=True)
    srv = ServerThread(app=app).start()
    try:
        status, body = http_get(srv.url + "/health")
        if not aengine.ready.is_set():  # still compiling: starting, and requests are turned away
            assert status == 503 and b"starting" in body
        deadline = time.monotonic() + 600
        while http_get(srv.url + "/health")[0] != 200:
            assert time.monotonic() < deadline and aengine.is_alive
            time.sleep(0.2)
        built = compilation.COUNTER.snapshot()[0]
        rng = np.random.default_rng()
        prompts = [rng.integers(2, 300, size=int(n)).tolist() for n in (3, 17, 31, 40, 70, 9)]  # 40, 70: chunked
        bodies = [dict(prompt=p, max_tokens=int(rng.integers(2, 12)), ignore_eos=True) for p in prompts]
        bodies[1].update(temperature=0.8, seed=3, top_p=0.9)
        bodies[2].update(logprobs=3)
        bodies[3].update(repetition_penalty=1.2, presence_penalty=0.5)  # the controls variant's History made
        bodies[4].update(temperature=0.7, frequency_penalty=0.4, min_tokens=2)
        _complete(srv.url, bodies[0])  # one alone, then all at once, then prefix hits of several prompts
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            list(ex.map(lambda b: _complete(srv.url, b), bodies))
            hits = [dict(b, prompt=b["prompt"] + [5, 6]) for b in bodies[2:5]]
            list(ex.map(lambda b: _complete(srv.url, b), hits + bodies[:2]))
        metrics = parse_metrics(http_get(srv.url + "/metrics")[1].decode())
        assert metrics["moejax:compiles_after_startup_total"] == 0
        assert compilation.COUNTER.snapshot()[0] == built
        assert metrics["moejax:startup_programs"] > 0 and metrics["vllm:prefix_cache_hits_total"] > 0
    finally:
        srv.stop()
    assert not aengine._thread.is_alive()  # the engine is this thread's now
    eng = model.engine
    for n in (5, 37, 80):
        seq = eng.add_request(rng.integers(2, 300, size=n).tolist(), SamplingParams(max_new_tokens=6, ignore_eos=True))
        while not seq.output_ids:
            eng.step()
        moved = add_prefilled(eng, take_prefilled(eng, seq))
        while not moved.is_finished:
            eng.step()
        assert moved.num_output_tokens == 6
    assert compilation.COUNTER.snapshot()[0] == built


def test_restart_with_cache_compiles_nothing(tiny_path, tmp_path):
    """Two processes with the same cache directory: the first compiles, the second only loads (a smaller
    engine than LOAD's: fewer buckets, the same kinds of program)."""
    small = dict(LOAD, max_model_len=32, max_num_seqs=2, max_prefill_tokens=16)
    script = textwrap.dedent(f"""
        import json, moejax
        from moejax import compilation
        m = moejax.load({tiny_path!r}, compilation_cache_dir={str(tmp_path)!r}, precompile=True,
                        **{small!r})
        built, hits = compilation.COUNTER.snapshot()
        print(json.dumps({{"built": built, "hits": hits}}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", compilation.ENV_VAR)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["built"] > 0 and first["built"] > first["hits"]
    assert second["built"] == second["hits"] > 0, second  # every program came from the cache
