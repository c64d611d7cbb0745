"""Speculative decoding with the MTP layer (issue 32) against the non-speculative engine (the reference):
the same tokens, logprobs, finish reasons and texts for greedy and seeded requests (bf16-free float32
models, "auto" and FP8 KV cache, k = 1 and 2, prefix-cache hits, chunked prompts, stop strings, length
limits); the accept path driven for real by injected drafts (always right: ~1/(k+1) of the steps; always
wrong: as many steps as without speculation), with stops and limits inside accepted runs; the sampled
distribution at a drafted position (chi-square against the model's own probabilities); dp8-ep8 with DBO
on 8 host devices; async scheduling (step N+1 fed on the device from step N, read after N+1 is
dispatched) against the synchronous loop with stops mid-run, preemption and aborts; start-up compilation
covering every speculative program; bad configurations refused naming the field.

The checkpoint is v3-tiny at two layers (conftest.v3_tiny_two_layers) with its MTP layer
(``num_nextn_predict_layers`` 1), random weights of std 0.1 (logits spread: greedy near-ties rare) from a fresh seed (the module fixture prints it)."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

import moejax
from moejax.config import EngineConfig
from moejax.engine.sampling_params import SamplingParams
from moejax.models.registry import parse_model_config
from moejax.server.async_engine import AsyncEngine
from moejax.server.metrics import Metrics, parse_metrics
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

from conftest import v3_tiny_two_layers

CFG = v3_tiny_two_layers(num_nextn_predict_layers=1)
V = CFG["vocab_size"]
# Small blocks and prefill budget: drafts cross block boundaries, prompts over 16 tokens are chunked. Few
# buckets (batches 1-4, four block-table widths): the file's time is mostly compilation.
KW = dict(dtype="float32", max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_tokens=16, progress=False)
# The FP8-cache comparisons run without prefix caching: a hit makes the rest of the prompt attend to FP8 rows
# instead of its own unquantised ones (1e-3 in logprobs), and the speculative engine's extra blocks evict
# differently from the reference's, so hits (and numerics) would depend on what ran before (a CI failure).
FP8_KV = dict(kv_cache_dtype="fp8", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"checkpoint seed {seed}")
    return make_random_checkpoint(str(tmp_path_factory.mktemp("mtp")), CFG, seed=seed, std=0.1)


_MODELS: dict = {}


def _load(path, k=0, **kw):
    if not k:  # the reference runs the loop speculative steps run (synchronous): the same batches, bit for bit
        kw.setdefault("async_scheduling", False)
    key = (path, k, tuple(sorted(kw.items())))
    if key not in _MODELS:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        _MODELS[key] = moejax.load(path, **{**KW, **kw}, speculative_config=spec)
    return _MODELS[key]


def _run(model, prompts, params):
    eng = model.engine
    steps0 = eng.stats.decode_steps
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.is_finished for s in seqs):
        kind, _ = eng.step()
        assert kind != "idle"
    assert eng.blocks.num_free == eng.blocks.num_blocks  # drafts' blocks freed with their sequence
    return [(s.output_ids, list(s.logprobs), s.finish_reason, s.text) for s in seqs], eng.stats.decode_steps - steps0


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[2:] == w[2:], (g, w)
        np.testing.assert_allclose(g[1], w[1], rtol=1e-5, atol=1e-5)


def _prompts(rng, n, lo=3, hi=24):
    return [rng.integers(2, V, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _mixed(rng, n):
    """Greedy, seeded top-p and top-logprobs requests, each with its own max_new_tokens, EOS ignored."""
    out = []
    for i in range(n):
        extra = [{}, dict(temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 30))), dict(top_logprobs=3)][i % 3]
        out.append(SamplingParams(max_new_tokens=int(rng.integers(2, 16)), ignore_eos=True, logprobs=True, **extra))
    return out


def test_same_tokens_as_reference(ckpt):
    """Greedy, seeded and top-logprobs requests (some prompts chunked), then the same prompts extended
    (prefix-cache hits): the speculative engine returns the reference's tokens, logprobs, finish reasons
    and texts. (Stop strings: test_accept_path_with_injected_drafts; k = 2 over an FP8 cache:
    test_precompile_covers_speculative_programs.)"""
    rng = np.random.default_rng()
    base, spec = _load(ckpt), _load(ckpt, 1)
    assert spec.engine.async_scheduling  # the default: speculative steps overlapped (test_async_*)
    prompts, params = _prompts(rng, 3), _mixed(rng, 3)  # one request of each kind
    want, _ = _run(base, prompts, params)
    _assert_same(_run(spec, prompts, params)[0], want)
    st = spec.engine.stats
    assert st.spec_num_draft_tokens > 0 and len(st.spec_accepted_per_pos) == 1
    hits = spec.engine.stats.prefix_cache_hits
    longer = [p + w[0] + rng.integers(2, V, size=3).tolist() for p, w in zip(prompts, want)]
    want2, _ = _run(base, longer, params)
    _assert_same(_run(spec, longer, params)[0], want2)
    assert spec.engine.stats.prefix_cache_hits > hits


def test_accept_path_with_injected_drafts(ckpt):
    """k = 2 (FP8 KV cache) with drafts injected from the reference's own greedy output: always right, every step
    accepts both (ceil((n - 1) / 3) steps for n tokens, the first from the prefill) and stop strings and
    max_new_tokens falling inside an accepted run cut it there; always wrong, as many steps as without
    speculation. Tokens, logprobs, finish reasons and texts are the reference's."""
    rng = np.random.default_rng()
    k = 2
    base, spec = _load(ckpt, **FP8_KV), _load(ckpt, k, **FP8_KV)
    prompts = _prompts(rng, 4, 3, 16)  # unchunked: every prompt is prefilled before the first decode step
    lens = [5, 6, 7, 11]  # n - 1 = 4, 5, 6, 11 decode tokens: every offset of a length limit in a run
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True) for n in lens]
    want, base_steps = _run(base, prompts, params)
    full = {tuple(p): p + w[0] + [0] * 8 for p, w in zip(prompts, want)}

    def right(seq):
        return full[tuple(seq.token_ids[:seq.num_prompt_tokens])][len(seq):len(seq) + k]

    drafter = spec.engine.runner.proposer
    try:
        drafter.draft_override = right
        acc0 = spec.engine.stats.spec_num_accepted_tokens
        got, steps = _run(spec, prompts, params)
        _assert_same(got, want)
        assert steps == max(-(-(n - 1) // (k + 1)) for n in lens), steps
        assert spec.engine.stats.spec_num_accepted_tokens - acc0 >= sum(lens) - len(lens) - k * len(lens)
        text = next(w[3] for w in want if len(w[3]) >= 5)  # a stop string the reference meets mid-output
        stop = [SamplingParams(max_new_tokens=11, ignore_eos=True, stop=[text[3:5]])] * len(prompts)
        want_stop, _ = _run(base, prompts, stop)
        assert any(w[2] == "stop" for w in want_stop)
        _assert_same(_run(spec, prompts, stop)[0], want_stop)
        drafter.draft_override = lambda seq: [(t + 1) % V for t in right(seq)]
        got, steps = _run(spec, prompts, params)
        _assert_same(got, want)
        assert steps == base_steps
    finally:
        drafter.draft_override = None


def test_sampled_distribution_at_drafted_positions(ckpt):
    """300 seeded requests (seeds 0..299) of one prompt at temperature 0.5, top-k 10, 2 tokens each; the second
    token is verified against a draft (the target's greedy token there, so drafts are both accepted and
    rejected). Its counts over the vocabulary are compared with the expected counts (the sum over requests
    of the model's top-10 softmax at temperature 0.5 after each request's first token, from model.score)
    by a chi-square test, categories of expected count < 5 merged: the test fails at p < 1e-3 (the draws'
    seeds are fixed; the model's is the module's). The same seeds give the same tokens again."""
    rng = np.random.default_rng()
    spec = _load(ckpt, 1)
    prompt = _prompts(rng, 1, 6, 12)[0]
    greedy = {}

    def best(seq):  # the target's own greedy token after the first output token
        a = seq.token_ids[-1]
        if a not in greedy:
            greedy[a] = int(np.argmax(spec.score([seq.token_ids])[0, -1]))
        return [greedy[a]]

    drafter = spec.engine.runner.proposer
    drafter.draft_override = best
    try:
        params = [SamplingParams(max_new_tokens=2, temperature=0.5, top_k=10, seed=s, ignore_eos=True) for s in range(300)]
        acc0, draft0 = spec.engine.stats.spec_num_accepted_tokens, spec.engine.stats.spec_num_draft_tokens
        got, _ = _run(spec, [prompt] * len(params), params)
        accepted = spec.engine.stats.spec_num_accepted_tokens - acc0
        assert 0 < accepted < spec.engine.stats.spec_num_draft_tokens - draft0  # both paths taken
        again, _ = _run(spec, [prompt] * 20, params[:20])
        assert [g[0] for g in again] == [g[0] for g in got[:20]]
    finally:
        drafter.draft_override = None
    firsts = sorted({g[0][0] for g in got})
    logits = spec.score([prompt + [a] for a in firsts])[:, -1].astype(np.float64) / 0.5
    logits[logits < np.sort(logits, axis=-1)[:, -10:-9]] = -np.inf  # top-k 10
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = dict(zip(firsts, probs / probs.sum(-1, keepdims=True)))
    expected = sum(probs[g[0][0]] for g in got)
    observed = np.bincount([g[0][1] for g in got], minlength=V).astype(np.float64)
    order = np.argsort(-expected)
    big = order[expected[order] >= 5]
    obs = np.append(observed[big], observed.sum() - observed[big].sum())
    exp = np.append(expected[big], expected.sum() - expected[big].sum())
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    from scipy.stats import chi2 as chi2_dist
    pval = float(chi2_dist.sf(chi2, keep.sum() - 1))
    assert pval > 1e-3, (chi2, keep.sum(), pval)


def test_mesh_dbo(ckpt, tmp_path):
    """dp8-ep8 with DBO on (each verify split in two micro-batches) on 8 host devices, k = 1: the
    speculative engine gives the non-speculative one's tokens on the same layout (one sequence a rank, short
    prompts: one bucket of each program)."""
    rng = np.random.default_rng()
    layout = tmp_path / "dp8-ep8-dbo.yaml"
    layout.write_text("data_parallel_size: 8\nexpert_parallel_size: 8\nmoe_backend: a2a\ndbo: 'on'\n")
    prompts, params = _prompts(rng, 8, 3, 8), _mixed(rng, 8)
    want, _ = _run(_load(ckpt, parallel=str(layout)), prompts, params)
    _assert_same(_run(_load(ckpt, 1, parallel=str(layout)), prompts, params)[0], want)


def test_precompile_covers_speculative_programs(ckpt):
    """k = 2 over an FP8 KV cache: after start-up compilation nothing the speculative engine runs traces a
    program again, and it returns the reference's tokens, logprobs, finish reasons and texts."""
    small = dict(max_num_seqs=2, max_model_len=16, kv_cache_dtype="fp8")
    spec = _load(ckpt, 2, **small)
    spec.engine.precompile(progress=False)
    counts = dict(spec.engine.runner.trace_counts)
    rng = np.random.default_rng()
    prompts = _prompts(rng, 3, 3, 12)
    prompts, params = prompts + [prompts[0] + [5, 6, 7]], _mixed(rng, 4)
    got, _ = _run(spec, prompts, params)
    assert dict(spec.engine.runner.trace_counts) == counts
    want, _ = _run(_load(ckpt, **small), prompts, params)
    _assert_same(got, want)
    assert spec.engine.stats.spec_num_draft_tokens > 0 and len(spec.engine.stats.spec_accepted_per_pos) == 2


def test_bad_configs_refused(ckpt):
    model = parse_model_config(CFG)
    bad = [({"method": "mtp", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
           ({"method": "mtp", "num_speculative_tokens": 1.5}, "speculative_config.num_speculative_tokens"),
           ({"method": "mtp", "num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens"),
           ({"method": "mtp"}, "speculative_config.num_speculative_tokens"),
           ({"method": "eagle", "num_speculative_tokens": 1}, "speculative_config.method"),
           ({"method": "mtp", "num_speculative_tokens": 1, "draft_model": "x"}, "speculative_config.draft_model"),
           ("mtp", "speculative_config must be a dict")]
    for value, field in bad:
        with pytest.raises(ValueError, match=field):
            EngineConfig.create(model, max_model_len=64, speculative_config=value)
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        EngineConfig.create(parse_model_config(preset("v3-tiny")), max_model_len=64,
                            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    ok = EngineConfig.create(model, max_model_len=64, speculative_config={"method": "deepseek_mtp",
                                                                         "num_speculative_tokens": 2})
    assert (ok.num_speculative_tokens, ok.num_cache_layers) == (2, CFG["num_hidden_layers"] + 1)


def test_streamed_through_server_engine_thread_with_metrics(ckpt):
    """k = 2, drafts always right (each step gives a sequence up to 3 tokens): AsyncEngine (the server's engine
    thread) streams every token as its own event, the reference's tokens, logprobs and text; /metrics carries
    vLLM's spec_decode counters (accepted = what the engine counted, per position too)."""
    rng = np.random.default_rng()
    base, spec = _load(ckpt, **FP8_KV), _load(ckpt, 2, **FP8_KV)
    prompts = _prompts(rng, 3, 3, 16)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True) for n in (4, 9, 10)]
    want, _ = _run(base, prompts, params)
    full = {tuple(p): p + w[0] + [0] * 8 for p, w in zip(prompts, want)}
    drafter = spec.engine.runner.proposer
    drafter.draft_override = lambda seq: full[tuple(seq.token_ids[:seq.num_prompt_tokens])][len(seq):len(seq) + 2]
    metrics = Metrics("t")

    async def go():
        eng = AsyncEngine(spec.engine, "t", metrics=metrics).start()
        try:
            out = []
            for st in [await eng.add_request(p, sp) for p, sp in zip(prompts, params)]:
                toks, lps, last = [], [], None
                while last is None:
                    ev = await st.get(timeout=60)
                    assert ev is not None and ev.error is None
                    toks.append(ev.token_id)
                    lps.append(ev.logprob)
                    last = ev if ev.finish_reason is not None else None
                out.append((toks, lps, last.finish_reason, last.text))
            return out
        finally:
            eng.shutdown()
    try:
        got = asyncio.run(go())
    finally:
        drafter.draft_override = None
    _assert_same(got, want)
    m, st = parse_metrics(metrics.render()), spec.engine.stats
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == st.spec_num_accepted_tokens > 0
    assert m["vllm:spec_decode_num_draft_tokens_total"] == st.spec_num_draft_tokens
    assert m["vllm:spec_decode_num_drafts_total"] == st.spec_num_drafts
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == st.spec_num_accepted_tokens
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="t",position="1"}'] == \
        st.spec_accepted_per_pos[1] > 0
    assert m["vllm:generation_tokens_total"] == sum(len(w[0]) for w in want)


def test_fp8_weights_same_tokens(tmp_path):
    """A block-FP8 checkpoint (its MTP layer FP8 like the rest, weight_dtype "auto"): speculation (k = 1)
    gives the non-speculative engine's greedy and seeded tokens on the same FP8 weights."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"checkpoint seed {seed}")
    path = make_random_checkpoint(str(tmp_path), CFG, seed=seed, std=0.1, fp8=True)
    rng = np.random.default_rng(seed)
    base, spec = _load(path), _load(path, 1)
    assert any(str(x.dtype) == "float8_e4m3fn" for x in jax.tree.leaves(spec.engine.runner.params))
    prompts, params = _prompts(rng, 3), _mixed(rng, 3)
    want, _ = _run(base, prompts, params)
    got, _ = _run(spec, prompts, params)
    _assert_same(got, want)
    assert spec.engine.stats.spec_num_drafts > 0


def _recording(spec):
    """Wraps the proposer's dispatch and read to record ("dispatch" | "read", step number) in order."""
    drafter, events, ids = spec.engine.runner.proposer, [], {}
    dispatch, read = drafter.dispatch, drafter.read

    def rec_dispatch(seqs, prev=None):
        step = dispatch(seqs, prev)
        ids[id(step)] = len(ids)
        events.append(("dispatch", ids[id(step)], prev is not None))
        return step

    def rec_read(step):
        events.append(("read", ids[id(step)], None))
        return read(step)
    drafter.dispatch, drafter.read = rec_dispatch, rec_read
    return events, lambda: (delattr(drafter, "dispatch"), delattr(drafter, "read"))


def _overlapped_reads(events) -> int:
    """Reads of a step made after the next step was dispatched (fed from it on the device)."""
    at = {(e, n): i for i, (e, n, _) in enumerate(events)}
    return sum(1 for e, n, fed in events if e == "dispatch" and fed and at[("dispatch", n)] < at[("read", n - 1)])


def test_async_same_tokens_as_sync_and_reference(ckpt):
    """Async scheduling (speculative step N+1 dispatched before step N is read, its inputs built on the device
    from N's outputs) against the synchronous speculative engine and the non-speculative one: greedy, seeded
    top-p and top-logprobs requests, with EOS (a token of the reference's output as a stop token), stop strings
    and max_tokens landing mid-run; the same tokens, logprobs, finish reasons and texts. The recorded order
    shows the host reading step N only after N+1 was dispatched."""
    rng = np.random.default_rng()
    base, sync, spec = _load(ckpt), _load(ckpt, 1, async_scheduling=False), _load(ckpt, 1)
    assert spec.engine.async_scheduling and not sync.engine.async_scheduling
    prompts, params = _prompts(rng, 4, 3, 14), _mixed(rng, 4)
    want, _ = _run(base, prompts, params)
    # Stops mid-run: a token of each reference output as its stop token, a stop string, EOS not ignored.
    text = next(w[3] for w in want if len(w[3]) >= 6)
    stops = [dataclasses.replace(p, stop_token_ids=[w[0][len(w[0]) // 2]], ignore_eos=False)
             if i % 2 == 0 else dataclasses.replace(p, stop=[text[2:4]])
             for i, (p, w) in enumerate(zip(params, want))]
    want_stop, _ = _run(base, prompts, stops)
    assert any(w[2] == "stop" for w in want_stop)
    events, undo = _recording(spec)
    try:
        for ps, w in ((params, want), (stops, want_stop)):
            _assert_same(_run(sync, prompts, ps)[0], w)
            _assert_same(_run(spec, prompts, ps)[0], w)
    finally:
        undo()
    assert _overlapped_reads(events) >= 4, events  # (accepted drafts fed on the device: test_step_inputs_*)


def test_async_preemption_and_abort(ckpt):
    """A 10-block cache (80 slots for 4 sequences of up to 46 tokens, 2(k+1) reserved ahead): sequences are
    preempted with a step in flight and recomputed, losing nothing accepted; a request aborted with a step in
    flight ends with a prefix of the reference's tokens and frees its blocks, the others unchanged."""
    rng = np.random.default_rng()
    base, spec = _load(ckpt), _load(ckpt, 1, num_kv_blocks=10)
    prompts = _prompts(rng, 4, 8, 16)
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=True, seed=i, temperature=0.7)
              for i in range(4)]
    want, _ = _run(base, prompts, params)
    pre0 = spec.engine.scheduler.num_preemptions
    _assert_same(_run(spec, prompts, params)[0], want)
    assert spec.engine.scheduler.num_preemptions > pre0
    eng = spec.engine
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    while seqs[0].num_output_tokens < 6:
        eng.step()
    assert eng._in_flight is not None and seqs[0].num_pending_tokens
    eng.abort(seqs[0])
    while not seqs[1].is_finished:
        eng.step()
    assert seqs[0].finish_reason == "abort" and seqs[0].output_ids == want[0][0][:len(seqs[0].output_ids)]
    assert (seqs[1].output_ids, seqs[1].finish_reason) == (want[1][0], want[1][2])
    while eng._in_flight is not None:  # the step dispatched with seqs[1] before its end was read: discarded
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_step_inputs_fed_on_device_equal_the_hosts(ckpt):
    """The verify's inputs built on the device (SpecDecoder._step_inputs), k = 2, random states (seed
    recorded): a row fed from the step in flight (n of its drafts accepted, 0..k) equals the row the host
    builds once it has appended those n + 1 tokens, and both equal the NumPy construction (drafts cut to the
    blocks held and to max_model_len; padding rows write nothing)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"step inputs seed {seed}")
    rng = np.random.default_rng(seed)
    drafter = _load(ckpt, 2, **FP8_KV).engine.runner.proposer
    r, k, R = drafter.runner, drafter.k, drafter.R
    bs, mml, pad, B, W = r.block_size, r.max_model_len, r.buckets.max_decode_batch, 4, 8
    build = jax.jit(drafter._step_inputs)
    prev_tokens = rng.integers(0, V, (pad, R)).astype(np.int32)
    prev_n = rng.integers(0, R, pad).astype(np.int32)
    rows = rng.permutation(pad)[:B].astype(np.int32)
    L = rng.integers(2, mml - 2 * R, B).astype(np.int32)  # host lengths (the in-flight step's tokens not appended)
    L[0] = mml - R - prev_n[rows[0]]  # a row whose drafts max_model_len cuts
    nblk = np.minimum(-(-(L + prev_n[rows] + 1 + rng.integers(0, 2 * k, B)) // bs), W)
    tables = np.zeros((B, W), np.int32)
    for i in range(B):
        tables[i, :nblk[i]] = rng.permutation(r.num_blocks)[:nblk[i]]
    cap = (nblk * bs).astype(np.int32)
    tables[B - 1], cap[B - 1], L[B - 1], rows[B - 1] = 0, 0, 1, -1  # a padding row
    host = np.zeros((B, R), np.int32)
    fed = build(prev_tokens, prev_n, rows, host, L - 1, np.zeros(B, np.int32), tables, cap)
    # The host's rows after appending the accepted tokens: last token and drafts from the step's outputs.
    P = np.where(rows >= 0, L + prev_n[np.maximum(rows, 0)], 0)
    host[rows >= 0] = prev_tokens[rows[rows >= 0]]
    nd = np.where(rows >= 0, k, 0).astype(np.int32)
    own = build(prev_tokens, prev_n, np.full(B, -1, np.int32), host, P.astype(np.int32), nd, tables, cap)
    for a, b in zip(fed, own):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens, positions, slots, lens, valid = (np.asarray(a) for a in fed)
    for i in range(B):
        n_len = P[i] + 1
        nv = max(0, min(nd[i], cap[i] - n_len, mml - n_len - 1))
        want_slots = np.full(R, r.num_slots)
        if cap[i]:
            want_slots[:nv + 1] = r.slots(tables[i], P[i] + np.arange(nv + 1))
        assert valid[i] == nv, (i, nv)
        np.testing.assert_array_equal(tokens[i], np.where(np.arange(R) <= nv, host[i], 0))
        np.testing.assert_array_equal(positions[i], P[i] + np.arange(R))
        np.testing.assert_array_equal(lens[i], P[i] + np.minimum(np.arange(R), nv) + 1)
        np.testing.assert_array_equal(slots[i], want_slots)
    assert valid[0] == k - 1 and valid[B - 1] == 0 and (slots[B - 1] == r.num_slots).all()
