"""Async scheduling (the overlapped decode loop) against the synchronous loop: the same token ids,
logprobs, finish reasons and texts for greedy and seeded sampling, stop strings, EOS, differing
max_new_tokens, an abort mid-generation and a streamed request through the server's engine thread;
step t+1 is dispatched before step t is read. (Preemption under the async loop, now the default:
tests/test_engine.py::test_preemption_loses_nothing, against a synchronous run.)"""

import asyncio

import numpy as np
import pytest

import moejax
from moejax.engine.sampling_params import SamplingParams
from moejax.server.async_engine import AsyncEngine
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=13, std=0.1)


def _load(path, async_scheduling, **kw):
    kw = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "progress": False, **kw}
    return moejax.load(path, async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def models(tiny_path):
    """(synchronous, overlapped) engines of one checkpoint."""
    return _load(tiny_path, False), _load(tiny_path, True)


def _prompts(n, rng, lo=3, hi=20):
    return [rng.integers(2, 320, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _run(model, prompts, params, abort=None):
    """Every request through the engine's step loop; ``abort`` = (request index, output tokens): that
    request is aborted (engine.abort, as the server does) once it has that many tokens."""
    eng = model.engine
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.is_finished for s in seqs):
        kind, _ = eng.step()
        assert kind != "idle"
        if abort is not None and seqs[abort[0]].num_output_tokens >= abort[1]:
            eng.abort(seqs[abort[0]])
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [(s.output_ids, list(s.logprobs), s.finish_reason, s.text) for s in seqs]


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[2:] == w[2:], (g, w)
        np.testing.assert_allclose(g[1], w[1], rtol=1e-6, atol=1e-6)


def _mixed_params(rng, n, **kw):
    """Greedy and seeded sampled requests alternating, each with its own max_new_tokens."""
    out = []
    for i in range(n):
        sample = dict(temperature=0.9, top_p=0.85, top_k=40, seed=int(rng.integers(1 << 30))) if i % 2 else {}
        out.append(SamplingParams(max_new_tokens=int(rng.integers(1, 24)), logprobs=True, **sample, **kw))
    return out


def test_greedy_and_seeded_sampling_same_tokens(models):
    """Greedy and seeded top-k/top-p requests with max_new_tokens from 1 to 23, ignoring EOS: the
    overlapped loop gives the synchronous loop's tokens and logprobs."""
    rng = np.random.default_rng()
    prompts, params = _prompts(7, rng), _mixed_params(rng, 7, ignore_eos=True)
    sync, overlapped = models
    want = _run(sync, prompts, params)
    _assert_same(_run(overlapped, prompts, params), want)
    assert [len(w[0]) for w in want] == [p.max_new_tokens for p in params]


def test_eos_and_stop_strings_end_sequences_mid_batch(models):
    """EOS (not ignored) and a stop string end some sequences while the others run on: the finished
    ones' extra token is discarded, nothing of it emitted; the rest match the synchronous loop."""
    rng = np.random.default_rng()
    sync, overlapped = models
    prompts = _prompts(6, rng)
    free = _run(sync, prompts, [SamplingParams(max_new_tokens=20, ignore_eos=True) for _ in prompts])
    # an EOS token that one sequence samples part-way through
    eos = free[0][0][int(rng.integers(2, 8))]
    stop, who = None, None
    for i in range(1, len(prompts)):  # an ASCII stop string inside another's text (random bytes: try each)
        text = free[i][3]
        stop = next((text[j:j + 2] for j in range(3, len(text) - 2)
                     if text[j:j + 2].isascii() and text[j:j + 2].isprintable() and text[j:j + 2].strip()), None)
        if stop is not None:
            who = i
            break
    params = _mixed_params(rng, len(prompts))
    for p in params:
        p.max_new_tokens = 20
    params[0].temperature = 0.0  # the EOS sequence greedy, so it does reach the token
    if who is not None:
        params[who].stop, params[who].temperature = [stop], 0.0
    saved = [m.engine.eos_token_ids for m in models]
    for m in models:
        m.engine.eos_token_ids = {eos}
    try:
        want = _run(sync, prompts, params)
        got = _run(overlapped, prompts, params)
    finally:
        for m, ids in zip(models, saved):
            m.engine.eos_token_ids = ids
    _assert_same(got, want)
    assert want[0][2] == "stop" and want[0][0][-1] == eos and len(want[0][0]) < 20
    if who is not None:
        assert want[who][2] == "stop" and stop not in want[who][3]


def test_abort_mid_generation(models):
    """A running request aborted (engine.abort) after a few tokens: it keeps exactly the synchronous
    loop's tokens up to then, finishes "abort"; the others are unchanged; every block is free."""
    rng = np.random.default_rng()
    prompts, params = _prompts(5, rng), _mixed_params(rng, 5, ignore_eos=True)
    for p in params:
        p.max_new_tokens = 16
    at = (int(rng.integers(5)), int(rng.integers(2, 10)))
    sync, overlapped = models
    want = _run(sync, prompts, params, abort=at)
    got = _run(overlapped, prompts, params, abort=at)
    _assert_same(got, want)
    assert got[at[0]][2] == "abort" and len(got[at[0]][0]) == at[1]


def test_step_t_plus_1_dispatched_before_step_t_is_read(models):
    """The overlap itself: every decode step after the first is dispatched before the host reads the
    one before it, and the host reads each step once, in order."""
    _, overlapped = models
    runner = overlapped.engine.runner
    events, real_dispatch, real_read = [], runner.dispatch_decode, runner.read

    def dispatch(seqs, prev=None):
        step = real_dispatch(seqs, prev)
        events.append(("dispatch", id(step)))
        return step

    def read(step):
        events.append(("read", id(step)))
        return real_read(step)

    runner.dispatch_decode, runner.read = dispatch, read
    try:
        moejax.generate(overlapped, _prompts(3, np.random.default_rng()), max_new_tokens=8, ignore_eos=True)
    finally:
        runner.dispatch_decode, runner.read = real_dispatch, real_read
    dispatched = [i for k, i in events if k == "dispatch"]
    assert [i for k, i in events if k == "read"] == dispatched and len(dispatched) == 7
    # dispatch 1, dispatch 2, read 1, dispatch 3, read 2, ...: never a read before the next dispatch
    assert [k for k, _ in events] == ["dispatch"] + ["dispatch", "read"] * 6 + ["read"]


def test_streamed_through_the_server_engine_thread(models):
    """Requests streamed through AsyncEngine (the server's engine thread) on the overlapped engine,
    one of them aborted by the client mid-stream: each token event and the final text as in the
    synchronous loop; the aborted stream ends "abort" after a prefix of the synchronous tokens."""
    rng = np.random.default_rng()
    sync, overlapped = models
    prompts, params = _prompts(4, rng), _mixed_params(rng, 4, ignore_eos=True)
    params[0].max_new_tokens = 20
    want = _run(sync, prompts, params)

    async def go():
        eng = AsyncEngine(overlapped.engine, "t").start()
        try:
            streams = [await eng.add_request(p, sp) for p, sp in zip(prompts, params)]
            out = []
            for i, st in enumerate(streams):
                toks, lps, last = [], [], None
                while last is None:
                    ev = await st.get(timeout=60)
                    assert ev is not None and ev.error is None
                    if ev.token_id is not None:
                        toks.append(ev.token_id)
                        lps.append(ev.logprob)
                    if ev.finish_reason is not None:
                        last = ev
                    if i == 0 and len(toks) == 3:
                        st.abort()
                out.append((toks, lps, last.finish_reason, last.text))
            return out
        finally:
            eng.shutdown()

    got = asyncio.run(go())
    _assert_same(got[1:], want[1:])
    toks, _, reason, _ = got[0]
    assert reason == "abort" and toks == want[0][0][:len(toks)] and 3 <= len(toks) < 20
    assert overlapped.engine.blocks.num_free == overlapped.engine.blocks.num_blocks


def test_async_scheduling_is_checked(tiny_path):
    with pytest.raises(ValueError, match="async_scheduling"):
        _load(tiny_path, "yes")


def test_decode_step_has_no_device_side_branch(models):
    """Invariant behind the overlap: the compiled decode step and the sampler holds no ``conditional``
    (XLA:GPU reads its predicate back to the host before launching a branch, so the call would return
    only once the step had run), whatever the batch samples; what the batch needs is a static mode with a
    sampler variant each: a greedy batch's variant has no loop either (no random bits: CPU's threefry is
    a loop)."""
    import re

    from moejax.layers.sampler import SampleMode
    m = models[0]
    runner = m.engine.runner
    got, steps = {}, []
    real, real_sample = runner._decode, runner._sample

    def capture(*args):
        steps.append(args)
        return real(*args)

    def capture_sample(*args):
        got.setdefault(args[6], args)  # the mode is the seventh (static) argument
        return real_sample(*args)

    runner._decode, runner._sample = capture, capture_sample
    try:
        rng = np.random.default_rng()
        _run(m, _prompts(3, rng), [SamplingParams(max_new_tokens=3, ignore_eos=True),
                                   SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.8, seed=1),
                                   SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2)])
        _run(m, _prompts(2, rng), [SamplingParams(max_new_tokens=3, ignore_eos=True)] * 2)
    finally:
        runner._decode, runner._sample = real, real_sample
    # the programs those modes run (on CPU greedy and top-logprob batches share one: buckets.sample_mode)
    assert {runner.buckets.sample_mode(SampleMode(True, True, False)),
            runner.buckets.sample_mode(SampleMode(False, False, False))} <= set(got)
    assert not re.search(r"\bconditional\(", real.lower(*steps[-1]).compile().as_text())
    for mode, args in got.items():
        hlo = real_sample.lower(*args).compile().as_text()
        assert not re.search(r"\bconditional\(", hlo), mode
        if not mode.random:
            assert not re.search(r"\bwhile\(", hlo)
