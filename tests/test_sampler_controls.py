"""The sampling controls (layers/sampler.py, engine/sample_controls.py) against a NumPy float64 reference
of vLLM's rules on random logits and histories (seed printed): the mask, bad words (one and several
tokens), logit bias, the repetition / frequency / presence penalties, min_p; the device history rebuilt
from tokens equals the one counted step by step; then greedy end to end through the tiny model (async
scheduling): allowed_token_ids, bad_words, min_tokens and the penalties as a NumPy greedy loop over the
model's own logits says."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.engine import sample_controls
from moejax.engine.sample_controls import HistoryRows, load_chunks, prepare, step_arrays
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.sequence import Sequence
from moejax.layers import sampler
from moejax.layers.sampler import CONTROLS, RECENT, History, SampleMode, SampleControls
from moejax.tiny.checkpoint import make_random_checkpoint

from conftest import v3_tiny_two_layers


class IdTokenizer:
    """Text "5 7" is the token ids [5, 7] (bad words by id in the unit tests)."""

    def encode(self, text, add_special_tokens=False):
        return [int(x) for x in text.split()]


def reference(logits, params, prompt, output):
    """vLLM's processing of one row's logits before the temperature, in float64."""
    x = logits.astype(np.float64).copy()
    V = len(x)
    if params.allowed_token_ids is not None:
        keep = np.zeros(V, bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = -np.inf
    for w in [[int(t) for t in b.split()] for b in params.bad_words]:
        if len(w) - 1 <= len(output) and (len(w) == 1 or list(output[-(len(w) - 1):]) == w[:-1]):
            x[w[-1]] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)[:V].astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    pen = np.where(seen, params.repetition_penalty, 1.0)
    x = np.where(x > 0, x / pen, x * pen)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def _random_case(rng, V):
    prompt = rng.integers(0, V, size=int(rng.integers(1, 30))).tolist()
    output = rng.integers(0, V // 4, size=int(rng.integers(0, 40))).tolist()  # repeats: counts above 1
    kw = {}
    if rng.random() < 0.5:
        kw["allowed_token_ids"] = sorted(set(rng.integers(0, V, size=int(rng.integers(1, V // 2))).tolist()))
    if rng.random() < 0.6:
        kw["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V, size=5)}
    if rng.random() < 0.6 and output:
        words = [str(int(rng.integers(0, V)))]
        n = int(rng.integers(1, min(len(output), 4) + 1))
        # a word whose prefix ends the output
        words.append(" ".join(str(t) for t in output[-n:]) + f" {int(rng.integers(0, V))}")
        words.append(f"{V - 1} {V - 2} 3")  # a prefix the output does not end with
        kw["bad_words"] = words
    if rng.random() < 0.8:
        kw.update(presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                  repetition_penalty=float(rng.uniform(0.5, 2)))
    return prompt, output, SamplingParams(max_new_tokens=100, **kw)


def _batch(rng, B, V):
    seqs = []
    for _ in range(B):
        prompt, output, p = _random_case(rng, V)
        if not p.uses_controls:
            p = SamplingParams(max_new_tokens=100, presence_penalty=0.5)
        s = Sequence(prompt + output, p, seed=1)
        s.num_prompt_tokens = len(prompt)
        s.num_cached_tokens = len(s)
        s.controls = prepare(p, IdTokenizer(), V, ())
        seqs.append(s)
    return seqs


def _history_of(seqs, rows, V):
    """A History with each sequence's rebuilt row (load_history over its chunks)."""
    h = History(jnp.zeros((len(seqs), V), jnp.int32), jnp.full((len(seqs), RECENT), -1, jnp.int32))
    for s in seqs:
        if s.seq_id in rows.row_of:
            r = rows.row_of[s.seq_id][1]
            for first, p, o, rec in load_chunks(s, V):
                h = sampler.load_history(h, jnp.int32(r), jnp.asarray(first), p, o, rec)
    return h


def test_controls_match_vllms_formulas():
    """apply_controls on random logits, histories and controls of every kind equals the NumPy reference;
    greedy rows of the controls variant take its argmax; a row without controls is untouched."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    B, V = 24, 203  # V not a multiple of 32: the mask's last word is partial
    seqs = _batch(rng, B, V)
    rows = HistoryRows(1, B)
    controls, rebuild = step_arrays([seqs], B, V, rows, lambda s: True)
    assert len(rebuild) == sum(s.controls.needs_history for s in seqs)
    history = _history_of(seqs, rows, V)
    c = SampleControls(*(jnp.asarray(a[0]) for a in controls))
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    row, recent = sampler.read_history(history, c.rows)
    got = np.asarray(sampler.apply_controls(jnp.asarray(logits), c, row, recent))
    for i, s in enumerate(seqs):
        want = reference(logits[i], s.params, s.token_ids[:s.num_prompt_tokens], s.output_ids)
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=f"row {i}")
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[i][fin], want[fin], rtol=1e-5, atol=1e-4, err_msg=f"row {i}")
    z = jnp.zeros(B, jnp.float32)
    toks = sampler.sample(jnp.asarray(logits), z, z + 1, jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.uint32),
                          jnp.zeros(B, jnp.int32), CONTROLS, c, row, recent)[0]
    np.testing.assert_array_equal(np.asarray(toks), np.argmax(got, axis=-1))
    # neutral controls change nothing: a row whose controls are all off keeps its logits
    off = SampleControls(*(jnp.asarray(a[0]) for a in step_arrays([[]], B, V, HistoryRows(1, B), bool)[0]))
    r0, rec0 = sampler.read_history(history, off.rows)
    np.testing.assert_array_equal(np.asarray(sampler.apply_controls(jnp.asarray(logits), off, r0, rec0)), logits)


def test_recorded_history_equals_rebuilt():
    """record() of each sampled token, step after step, gives the History that load_history rebuilds from the
    same tokens (so a row counted on the device and a row rebuilt after preemption agree)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    V, S = 77, 3
    seqs = [Sequence(rng.integers(0, V, size=9).tolist(), SamplingParams(presence_penalty=1.0), seed=0)
            for _ in range(S)]
    rows = HistoryRows(1, S)
    for s in seqs:
        rows.row(s, 0, set())
    h = _history_of(seqs, rows, V)
    at = jnp.asarray([rows.row_of[s.seq_id][1] for s in seqs], jnp.int32)
    for _ in range(20):
        toks = rng.integers(0, V, size=S)
        h = sampler.record(h, at, jnp.asarray(toks, jnp.int32))
        for s, t in zip(seqs, toks):
            s.token_ids.append(int(t))
    want = _history_of(seqs, rows, V)
    np.testing.assert_array_equal(np.asarray(h.counts), np.asarray(want.counts))
    np.testing.assert_array_equal(np.asarray(h.recent), np.asarray(want.recent))


def test_min_p_keeps_only_likely_tokens_and_neutral_controls_draw_the_same():
    """min_p (after the temperature): every draw has probability >= min_p x the top one; with every control
    neutral the controls variant draws the very tokens of the plain variant (same keys)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    B, V = 256, 64
    lg = (rng.standard_normal(V) * 2).astype(np.float32)
    top = np.argsort(lg)[-2:]
    lg[top[0]] = lg[top[1]] - 0.5  # a second token above min_p (0.53 x the top one after temperature 0.8)
    logits = jnp.asarray(np.repeat(lg[None], B, 0))
    temp = jnp.full(B, 0.8, jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 1 << 32, size=B, dtype=np.uint64).astype(np.uint32))
    pos = jnp.asarray(rng.integers(0, 4096, size=B), jnp.int32)
    one, zk = jnp.ones(B, jnp.float32), jnp.zeros(B, jnp.int32)
    neutral, _ = step_arrays([[]], B, V, HistoryRows(1, B), bool)
    c = SampleControls(*(jnp.asarray(a[0]) for a in neutral))
    h = History(jnp.zeros((1, V), jnp.int32), jnp.full((1, RECENT), -1, jnp.int32))
    row, recent = sampler.read_history(h, c.rows)
    plain = sampler.sample(logits, temp, one, zk, seeds, pos, SampleMode(True, True, True))[0]
    same = sampler.sample(logits, temp, one, zk, seeds, pos, CONTROLS, c, row, recent)[0]
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(same))
    min_p = 0.3
    c = c._replace(min_p=jnp.full(B, min_p, jnp.float32))
    toks = np.asarray(sampler.sample(logits, temp, one, zk, seeds, pos, CONTROLS, c, row, recent)[0])
    p = np.exp(np.asarray(logits[0], np.float64) / 0.8)
    p /= p.sum()
    assert (p[toks] >= min_p * p.max() - 1e-6).all()
    assert len(set(toks.tolist())) > 1 and (p < min_p * p.max()).any()  # it does draw, and drops some


def test_prepare_refuses_what_the_sampler_cannot_take():
    """Token ids outside the vocabulary, too many or too long bad words: a ValueError naming the field; no
    controls: None (the batch keeps its plain variant)."""
    V = 50
    assert prepare(SamplingParams(), IdTokenizer(), V, ()) is None
    for kw, field in ((dict(allowed_token_ids=[50]), "allowed_token_ids"),
                      (dict(logit_bias={99: 1.0}), "logit_bias"),
                      (dict(bad_words=["60"]), "bad_words"),
                      (dict(bad_words=[str(i) for i in range(sampler.MAX_BAD_WORDS + 1)]), "bad_words"),
                      (dict(bad_words=[" ".join(["1"] * (sampler.MAX_BAD_WORD_TOKENS + 1))]), "bad_words")):
        with pytest.raises(ValueError, match=field):
            prepare(SamplingParams(**kw), IdTokenizer(), V, ())
    with pytest.raises(ValueError, match="speculative"):
        prepare(SamplingParams(frequency_penalty=1.0), IdTokenizer(), V, (), speculative=True)
    for kw, field in ((dict(presence_penalty=2.5), "presence_penalty"),
                      (dict(frequency_penalty=-3), "frequency_penalty"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                      (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_new_tokens=5), "min_tokens"),
                      (dict(logit_bias={1: 101.0}), "logit_bias"),
                      (dict(allowed_token_ids=[]), "allowed_token_ids"),
                      (dict(bad_words=[""]), "bad_words"),
                      (dict(logit_bias={i: 1.0 for i in range(sampler.MAX_LOGIT_BIAS + 1)}), "logit_bias")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    words = sample_controls.bad_words_token_ids(["3 4"], IdTokenizer())
    assert words == [[3, 4]]
    # the params survive JSON (a disaggregated handoff's, a worker's body): logit_bias keys come back strings
    p = SamplingParams(logit_bias={5: 2.0}, bad_words=["x"], allowed_token_ids=[3], min_p=0.1, min_tokens=2,
                       repetition_penalty=1.2, presence_penalty=-1.0, frequency_penalty=0.5)
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))) == p


# ----- end to end, greedy through the tiny model ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), v3_tiny_two_layers(), seed=13, std=0.1)


@pytest.fixture(scope="module")
def model(tiny_path):
    return moejax.load(tiny_path, dtype="float32", max_model_len=64, max_num_seqs=4, progress=False,
                       kv_role="prefill")  # also the prefill side of the handoff test


def _run(model, prompts, params):
    eng = model.engine
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.is_finished for s in seqs):
        assert eng.step()[0] != "idle"
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [s.output_ids for s in seqs]


def _reference_greedy(model, prompt, n, pres, freq, rep):
    """Greedy decoding with vLLM's penalties applied in NumPy to the model's own logits (one scoring
    program: the sequence padded to max_model_len; causal, so the padding changes nothing before it)."""
    runner = model.engine.runner
    ids = list(prompt)
    params = SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)
    for _ in range(n):
        pad = np.zeros((1, runner.max_model_len), np.int32)
        pad[0, :len(ids)] = ids
        logits = runner.score(pad)[0, len(ids) - 1]
        ids.append(int(np.argmax(reference(logits, params, prompt, ids[len(prompt):]))))
    return ids[len(prompt):]


def test_end_to_end_greedy(model):
    """allowed_token_ids=[k] gives only k; bad words (a token and a pair of the free output) never appear;
    min_tokens holds a stop token back; penalties give the NumPy reference's greedy tokens; requests
    without controls in the same batch give their free tokens; more penalised requests than history rows
    (max_num_seqs 4, 6 requests) reuse rows."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    n = 12
    prompts = [rng.integers(4, 300, size=int(rng.integers(3, 12))).tolist() for _ in range(6)]
    free = _run(model, prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)] * 6)
    k = int(rng.integers(4, 300))
    out = _run(model, prompts[:2], [SamplingParams(max_new_tokens=n, ignore_eos=True, allowed_token_ids=[k]),
                                    SamplingParams(max_new_tokens=n, ignore_eos=True)])
    assert out[0] == [k] * n and out[1] == free[1]
    tok = model.tokenizer
    # a two-token word of the free output whose tokenisation (vLLM's rule) is a pair the output has
    pairs = [free[2][i:i + 2] for i in range(n - 1)]
    words = [w for w in map(tok.decode, pairs) if w.strip()] + ["ab"]  # (bad_words takes no blank word)
    hits = [w for w in words if any(x in pairs for x in sample_controls.bad_words_token_ids([w], tok))]
    word = hits[0] if hits else words[0]
    pair = sample_controls.bad_words_token_ids([word], tok)
    single = next((w for w in map(tok.decode, ([t] for t in free[3])) if w.strip()), "a")
    got = _run(model, prompts[2:4], [SamplingParams(max_new_tokens=n, ignore_eos=True, bad_words=[word]),
                                     SamplingParams(max_new_tokens=n, ignore_eos=True, bad_words=[single])])
    for w in pair:
        assert all(got[0][i:i + len(w)] != w for i in range(len(got[0]))), (w, got[0])
    assert got[0] != free[2] or not hits
    for w in sample_controls.bad_words_token_ids([single], tok):
        assert all(got[1][i:i + len(w)] != w for i in range(len(got[1])))
    stop = free[4][1]
    got = _run(model, prompts[4:5], [SamplingParams(max_new_tokens=n, stop_token_ids=[stop], min_tokens=5)])[0]
    assert len(got) >= 5 and stop not in got[:5] and (len(got) == n or got[-1] == stop)
    pens = [(0.0, 1.5, 1.0), (1.5, 0.0, 1.0), (0.0, 0.0, 1.8), (0.5, 0.5, 1.3), (0.0, 2.0, 1.0), (1.0, 0.0, 1.5)]
    got = _run(model, prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True, presence_penalty=p,
                                               frequency_penalty=f, repetition_penalty=r) for p, f, r in pens])
    for i, (p, f, r) in enumerate(pens):
        assert got[i] == _reference_greedy(model, prompts[i], n, p, f, r), i
    assert any(g != fr for g, fr in zip(got, free))  # the penalties do change greedy output


def test_generate_takes_the_controls(model):
    """moejax.generate: the same fields; a bad value is a ValueError naming the field."""
    out = moejax.generate(model, [[5, 6, 7]], max_new_tokens=4, ignore_eos=True, allowed_token_ids=[9])
    assert out[0].token_ids == [9] * 4
    for kw, field in ((dict(min_p=2.0), "min_p"), (dict(allowed_token_ids=[10 ** 6]), "allowed_token_ids"),
                      (dict(logit_bias={1: 500}), "logit_bias")):
        with pytest.raises(ValueError, match=field):
            moejax.generate(model, [[5, 6, 7]], max_new_tokens=4, **kw)


def test_penalties_survive_preemption_and_rebuilt_rows(model, tiny_path):
    """A cache too small for every sequence at once preempts and recomputes some (their history rows kept);
    then every row's bookkeeping is dropped mid-run, so each is rebuilt from the host's tokens: the tokens
    equal the unconstrained run's (the async loop's; this one synchronous)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 300, size=int(rng.integers(8, 20))).tolist() for _ in range(6)]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, presence_penalty=float(rng.uniform(0, 2)),
                             frequency_penalty=float(rng.uniform(0, 2)), repetition_penalty=float(rng.uniform(1, 2)),
                             bad_words=["ab cd"] if i % 2 else []) for i in range(6)]
    want = _run(model, prompts, params)
    small = moejax.load(tiny_path, dtype="float32", max_model_len=64, max_num_seqs=4, progress=False, block_size=8,
                        num_kv_blocks=10, async_scheduling=False)
    eng, controls, loads = small.engine, small.engine.runner.controls, []
    load = controls.load
    controls.load = lambda history, row, *a: loads.append(int(row.max())) or load(history, row, *a)
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while any(not s.is_finished for s in seqs):
        eng.step()
        steps += 1
        if steps == 12:  # the device rows are stale from here for the host: each is rebuilt when next sampled
            built = len(loads)
            controls.rows = HistoryRows(1, controls.rows.num_rows)
    assert eng.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == want
    assert len(loads) > built >= 4


def test_speculative_rows_take_the_controls(tmp_path_factory):
    """A speculative verify samples k + 1 rows a sequence: each takes the sequence's mask and bias, and
    min_tokens counts the row's own output position (drafts forced, so they are accepted where right):
    allowed_token_ids [m, s], s biased and a stop token held back until 5 tokens gives m x 5 then s; a
    penalty is refused (it would depend on the drafts)."""
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("mtp")), v3_tiny_two_layers(num_nextn_predict_layers=1),
                                  seed=5, std=0.1)
    spec = moejax.load(path, dtype="float32", max_model_len=64, max_num_seqs=4, block_size=8, progress=False,
                       speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    m, s = 40, 41
    spec.engine.runner.proposer.draft_override = lambda seq: [m, m]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    got = _run(spec, prompts, [SamplingParams(max_new_tokens=12, allowed_token_ids=[m, s], logit_bias={s: 50.0},
                                              min_tokens=5, stop_token_ids=[s]),
                               SamplingParams(max_new_tokens=6, ignore_eos=True, allowed_token_ids=[m + 2])])
    assert got == [[m] * 5 + [s], [m + 2] * 6]
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    with pytest.raises(ValueError, match="repetition_penalty"):
        spec.engine.add_request([5, 6], SamplingParams(repetition_penalty=1.2))


def test_handed_off_sequence_keeps_its_controls(model, tiny_path):
    """A sequence prefilled by one engine and decoded by another (disaggregation: kv_handoff) keeps its
    controls there, its history row rebuilt on the decode side: the colocated run's tokens."""
    from moejax.engine.kv_handoff import add_prefilled, take_prefilled
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, frequency_penalty=1.5, bad_words=["ab cd"]),
              SamplingParams(max_new_tokens=10, ignore_eos=True, allowed_token_ids=[21, 22])]
    prompts = [[7, 8, 9, 10, 7, 8], [30, 31, 32]]
    want = _run(model, prompts, params)
    decode = moejax.load(tiny_path, dtype="float32", max_model_len=64, max_num_seqs=4, progress=False,
                         block_size=8, kv_role="decode").engine
    a = model.engine
    seqs = [a.add_request(p, sp) for p, sp in zip(prompts, params)]
    moved = []
    while len(moved) < len(seqs):
        for s in a.step()[1]:
            moved.append(add_prefilled(decode, take_prefilled(a, s)))
    while any(not s.is_finished for s in moved):
        decode.step()
    got = {tuple(s.token_ids[:s.num_prompt_tokens]): s.output_ids for s in moved}
    assert [got[tuple(p)] for p in prompts] == want


def test_controls_variant_has_no_device_side_branch(model):
    """The controls variant, as the engine calls it, holds no ``conditional`` (layers/sampler.py: XLA:GPU would
    read its predicate back to the host before launching a branch)."""
    import re
    runner = model.engine.runner
    real, got = runner._sample, []

    def capture(*args):
        if args[6].controls:
            got.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a,
                                    args, is_leaf=lambda a: isinstance(a, SampleMode)))
        return real(*args)

    runner._sample = capture
    try:
        _run(model, [[5, 6, 7]], [SamplingParams(max_new_tokens=3, ignore_eos=True, presence_penalty=1.0)])
    finally:
        runner._sample = real
    assert got
    assert not re.search(r"\bconditional\(", real.lower(*got[-1]).compile().as_text())
