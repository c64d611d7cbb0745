"""Engine behaviour: compile counts, sampling, stop conditions, preemption, input errors."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_top_logprobs, log_softmax

import moejax
from moejax.engine.block_manager import BlockManager
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.sequence import Sequence
from moejax.layers.sampler import sample
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    return make_random_checkpoint(d, preset("v3-tiny"), seed=11, std=0.1)


def _load(path, **kw):
    kw = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "progress": False, **kw}
    return moejax.load(path, **kw)


def _prompts(n, rng, lo=3, hi=20):
    return [rng.integers(2, 320, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_steady_state_decode_compiles_once_per_bucket(tiny_path):
    """Many decode steps with the live batch varying inside one bucket compile one program."""
    m = _load(tiny_path, block_size=64)  # contexts stay in one block-table bucket (< 64 tokens)
    eng = m.engine
    rng = np.random.default_rng()

    def run(max_tokens):
        seqs = [eng.add_request(rng.integers(2, 320, size=int(rng.integers(3, 9))).tolist(),
                                SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.7, seed=i))
                for i, n in enumerate(max_tokens)]
        sizes = []
        while any(not s.is_finished for s in seqs):
            kind, stepped = eng.step()
            if kind == "decode":
                sizes.append(len(stepped))
        return sizes

    # 8 live sequences shrinking to 5 (bucket 8 throughout) over 30 steps.
    sizes = run([8, 10, 12, 30, 30, 30, 30, 30])
    assert eng.runner.trace_counts["decode"] == 1 and eng.runner.trace_counts["prefill"] == 1
    assert len(sizes) == 29 and max(sizes) == 8 and min(sizes) == 5
    run([12] * 7)  # 7 live: same bucket, nothing new
    assert eng.runner.trace_counts["decode"] == 1
    run([12, 12, 12])  # 3 live, bucket 4: exactly one more program
    assert eng.runner.trace_counts["decode"] == 2


def test_packed_prefill_matches_one_at_a_time(tiny_path):
    """Prompts of very different lengths prefilled together in one packed stream give each prompt's
    greedy tokens and logprobs (the first from the prefill's logits) of prefilling it alone (float32,
    1e-5); the stream is their total length in its bucket, not batch x the longest prompt, and its
    padding tokens count in no expert's statistics."""
    m = _load(tiny_path, enable_prefix_caching=False)  # every run prefills whole prompts
    rng = np.random.default_rng()
    lens = [150, 2, 1, 14, 9]  # alone: two stream buckets (160, 16), few compilations
    prompts = [rng.integers(2, 320, size=n).tolist() for n in lens]
    moejax.generate(m, prompts, max_new_tokens=1)  # the prefill step alone: its expert statistics
    k = m.config.model.num_experts_per_tok
    assert (m.engine.runner.last_expert_counts.sum(-1) == sum(lens) * k).all()  # padding is not routed
    kw = dict(max_new_tokens=4, ignore_eos=True, logprobs=True)
    together = moejax.generate(m, prompts, **kw)
    # the stream: their total (176) in its bucket (192; 256 on XLA:CPU, buckets.py's compile_bound), not 8 x 256
    assert m.engine.runner.last_prefill_tokens == m.engine.runner.buckets.packed(sum(lens))[0] <= 256
    for p, got in zip(prompts, together):
        alone = moejax.generate(m, [p], **kw)[0]
        assert got.token_ids == alone.token_ids
        np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_independent_of_batch(tiny_path):
    """Invariant: a seeded sample depends on its seed only, not on the batch it runs in (prompt i
    of a batch gets seed + i); another seed gives another sample."""
    m = _load(tiny_path)
    rng = np.random.default_rng()
    prompts = _prompts(4, rng)
    seed = int(rng.integers(1 << 30))
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True)
    alone = moejax.generate(m, [prompts[2]], seed=seed + 2, **kw)[0].token_ids
    batched = moejax.generate(m, prompts, seed=seed, **kw)[2].token_ids  # prompt 2 gets seed + 2
    assert alone == batched
    other = moejax.generate(m, [prompts[2]], seed=seed + 3, **kw)[0].token_ids
    assert other != alone


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_path):
    """Invariant: top_k=1 and top_p~0 sample exactly the greedy (temperature 0) tokens, whatever the seed."""
    m = _load(tiny_path)
    rng = np.random.default_rng()
    prompts = _prompts(3, rng)
    seed = int(rng.integers(1 << 30))
    greedy = [r.token_ids for r in moejax.generate(m, prompts, max_new_tokens=10, ignore_eos=True)]
    k1 = [r.token_ids for r in moejax.generate(m, prompts, max_new_tokens=10, temperature=1.5, top_k=1,
                                               seed=seed, ignore_eos=True)]
    p0 = [r.token_ids for r in moejax.generate(m, prompts, max_new_tokens=10, temperature=1.5, top_p=1e-6,
                                               seed=seed, ignore_eos=True)]
    assert greedy == k1 == p0


def test_sampling_follows_the_distribution(tiny_path):
    """Temperature-1 samples of the first token follow softmax(logits) (chi-square-ish bound)."""
    m = _load(tiny_path, max_num_seqs=64)
    prompt = [5, 9, 13, 17]
    probs = np.exp(m.score([prompt])[0, -1].astype(np.float64))
    probs /= probs.sum()
    n = 256
    out = moejax.generate(m, [prompt] * n, max_new_tokens=1, temperature=1.0, seed=int(np.random.default_rng().integers(1 << 30)))
    counts = np.bincount([r.token_ids[0] for r in out], minlength=len(probs))
    top = np.argsort(probs)[::-1][:5]
    for t in top:  # each frequent token within 5 standard deviations of its expectation
        assert abs(counts[t] - n * probs[t]) < 5 * np.sqrt(n * probs[t] * (1 - probs[t])) + 1


def test_logprobs_and_stop_strings(tiny_path):
    """Greedy logprobs (decode steps) against the log-softmax of score() over prompt + output (one
    prefill); a stop string cuts the text just before its first occurrence (finish "stop"), also when
    that leaves nothing."""
    m = _load(tiny_path)
    rng = np.random.default_rng()
    for _ in range(8):  # random bytes: try prompts until the output has ASCII text to stop on
        prompt = _prompts(1, rng)[0]
        full = moejax.generate(m, [prompt], max_new_tokens=32, ignore_eos=True, logprobs=True)[0]
        assert len(full.logprobs) == len(full.token_ids) and all(lp <= 0 for lp in full.logprobs)
        text = full.text
        # ASCII only: a prefix of random bytes decodes to different U+FFFD runs than the whole does.
        stop = next((text[i:i + 2] for i in range(4, len(text) - 2)
                     if text[i:i + 2].isascii() and text[i:i + 2].isprintable() and text[i:i + 2].strip()), None)
        if stop is not None:
            break
    assert stop is not None, "no ASCII text in 8 random outputs"
    logits = m.score([prompt + full.token_ids])[0, len(prompt) - 1:-1].astype(np.float64)
    lsm = logits - logits.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    np.testing.assert_allclose(full.logprobs, lsm[np.arange(len(full.token_ids)), full.token_ids], atol=1e-4)
    r = moejax.generate(m, [prompt], max_new_tokens=32, ignore_eos=True, stop=[stop])[0]
    assert r.finish_reason == "stop" and r.text == text[:text.find(stop)] and stop not in r.text
    # The whole output up to the stop string's end as the stop string: the text returned is empty
    # (an empty cut once fell back to the full decoded text, stop string included).
    head = text[:text.find(stop) + len(stop)]
    r = moejax.generate(m, [prompt], max_new_tokens=32, ignore_eos=True, stop=[head])[0]
    assert r.finish_reason == "stop" and r.text == "", (head, r.text)


def test_top_logprobs_match_score(tiny_path):
    """Top-N logprobs (N random per request, 0 for some; greedy and seeded sampling mixed in one batch)
    against the log-softmax of score() over prompt + output, through the one-shot prefill (short
    prompts), the paged prefill (a chunked long prompt) and decode steps: the N best of the raw
    distribution, descending; the sampled token's logprob is its entry there. Asking changes no token."""
    m = _load(tiny_path, max_prefill_tokens=16)
    eng, rng = m.engine, np.random.default_rng()
    total = 32  # prompt + output of every request: one score() call for all
    lens = [8, 12, 24, 24, 12, 8]  # 24 > max_prefill_tokens: chunked, its last chunk paged
    params = []
    for i, n in enumerate(lens):
        top = 0 if i == 4 else (20 if i == 1 else int(rng.integers(1, 21)))
        temp = 0.0 if i % 2 == 0 else 0.9
        params.append(SamplingParams(max_new_tokens=total - n, ignore_eos=True, logprobs=True, top_logprobs=top,
                                     temperature=temp, seed=int(rng.integers(1 << 30))))
    prompts = [rng.integers(2, 320, size=n).tolist() for n in lens]
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.run_to_completion(seqs)
    assert eng.runner.trace_counts["prefill_paged"] >= 1
    lsm = log_softmax(m.score([s.token_ids for s in seqs]))
    for b, (s, n, sp) in enumerate(zip(seqs, lens, params)):
        ref = lsm[b, n - 1:-1]
        out = s.output_ids
        np.testing.assert_allclose(s.logprobs, ref[np.arange(len(out)), out], atol=1e-4)
        if sp.top_logprobs == 0:
            assert s.top_logprobs == []
            continue
        assert len(s.top_logprobs) == len(out)
        for pos, (top, tok) in enumerate(zip(s.top_logprobs, out)):
            assert_top_logprobs(top, ref[pos], sp.top_logprobs)
            d = dict(top)
            if sp.temperature == 0:  # argmax and top-k of the same step agree exactly
                assert top[0][0] == tok
            if tok in d:
                assert d[tok] == s.logprobs[pos]
    # the same requests without top logprobs sample the same tokens
    plain = [eng.add_request(p, dataclasses.replace(sp, top_logprobs=0)) for p, sp in zip(prompts, params)]
    eng.run_to_completion(plain)
    assert [s.output_ids for s in plain] == [s.output_ids for s in seqs]
    # moejax.generate: {token id: logprob} per token, the greedy token first
    r = moejax.generate(m, [prompts[0]], max_new_tokens=3, top_logprobs=2, ignore_eos=True)[0]
    assert r.logprobs is None and len(r.top_logprobs) == 3
    assert all(len(d) == 2 and next(iter(d)) == t for d, t in zip(r.top_logprobs, r.token_ids))
    assert moejax.generate(m, [prompts[0]], max_new_tokens=2)[0].top_logprobs is None


def test_preemption_loses_nothing(tiny_path):
    """A cache too small for every sequence at once forces preemption; outputs (the async loop, the default)
    equal an unconstrained run of the synchronous loop.
    With max_preemptions=0 each preempted sequence is given up at once instead: finish_reason "error" with
    its error naming the bound, its tokens a prefix of the unconstrained run's; the others equal it."""
    rng = np.random.default_rng()
    prompts = _prompts(6, rng, 10, 30)
    big = _load(tiny_path, async_scheduling=False)
    want = [r.token_ids for r in moejax.generate(big, prompts, max_new_tokens=24, ignore_eos=True)]
    small = _load(tiny_path, block_size=8, num_kv_blocks=16, max_model_len=128)  # 128 slots for ~6 x 44 tokens
    got = [r.token_ids for r in moejax.generate(small, prompts, max_new_tokens=24, ignore_eos=True)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == want
    assert small.engine.blocks.num_free == 16

    bounded = _load(tiny_path, block_size=8, num_kv_blocks=16, max_model_len=128, max_preemptions=0)
    res = moejax.generate(bounded, prompts, max_new_tokens=24, ignore_eos=True)
    failed = [i for i, r in enumerate(res) if r.finish_reason == "error"]
    assert len(failed) == bounded.engine.scheduler.num_preemptions > 0
    for i, r in enumerate(res):
        if i in failed:
            assert "after 1 preemption(s) (max_preemptions=0)" in r.error and r.token_ids == want[i][:len(r.token_ids)]
        else:
            assert r.finish_reason == "length" and r.error is None and r.token_ids == want[i]
    assert bounded.engine.blocks.num_free == 16 and not bounded.engine.has_unfinished()


def test_decode_step_cost_does_not_grow_with_the_cache(tiny_path):
    """The compiled decode step of a bfloat16 model (the serving default) updates the donated cache in
    place: XLA's memory analysis shows the cache aliased to the output and temporaries far below the
    cache's size, the same at 256 and 4096 blocks. (XLA:CPU once converted a bf16 cache to float32 and
    back at every layer of every step: temporaries of twice the cache, 0.25 s a step for the default model.)"""
    temps, caches = {}, {}
    for blocks in (256, 4096):
        m = _load(tiny_path, dtype="bfloat16", num_kv_blocks=blocks, max_num_seqs=2)
        eng, runner = m.engine, m.engine.runner
        eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
        real, got = runner._decode, {}

        def capture(*args, real=real, got=got, **kw):
            got["args"], got["kw"] = args, kw
            return real(*args, **kw)

        runner._decode = capture
        while eng.has_unfinished():
            eng.step()
        ma = real.lower(*got["args"], **got["kw"]).compile().memory_analysis()
        temps[blocks], caches[blocks] = ma.temp_size_in_bytes, runner.cache.nbytes
        assert ma.alias_size_in_bytes >= caches[blocks]  # donated: written in place
    assert temps[4096] < caches[4096] / 8
    assert abs(temps[4096] - temps[256]) < (caches[4096] - caches[256]) / 100


def test_eos_stops_unless_ignored(tiny_path):
    """Invariant: with every token an EOS, generation stops after one token ("stop") unless
    ignore_eos, when it runs to max_new_tokens ("length")."""
    m = _load(tiny_path)
    m.engine.eos_token_ids = {t for t in range(320)}  # any token ends the sequence
    r = moejax.generate(m, [[4, 5, 6]], max_new_tokens=5)[0]
    assert r.finish_reason == "stop" and len(r.token_ids) == 1
    r = moejax.generate(m, [[4, 5, 6]], max_new_tokens=5, ignore_eos=True)[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 5


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"top_k": 2**40}, "top_k"),  # once an OverflowError in the engine thread
    ({"max_new_tokens": 2**40}, "max_new_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"stop": [3]}, "stop"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2.0}, "top_logprobs"),
])
def test_bad_generate_arguments_are_named(tiny_path, kwargs, needle):
    """Invariant: an invalid sampling argument is refused with an error naming it."""
    m = _load(tiny_path)
    with pytest.raises(ValueError, match=needle):
        moejax.generate(m, ["hello"], **kwargs)


def test_bad_prompts_are_named(tiny_path):
    """Invariant: a bad prompt is refused with an error naming its index and the problem; the engine
    keeps working afterwards and every KV block is free again."""
    m = _load(tiny_path, max_model_len=32)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        moejax.generate(m, ["ok", 3.5])
    with pytest.raises(ValueError, match=r"prompts\[0\].*maximum context length"):
        moejax.generate(m, [list(range(2, 40))])
    with pytest.raises(ValueError, match=r"prompts\[0\].*token ids"):
        moejax.generate(m, [[1, 2, 99999]])
    with pytest.raises(ValueError, match="token_ids"):
        m.score([[1, 2], [3]])
    # the engine still works afterwards, and nothing leaked
    assert moejax.generate(m, ["fine"], max_new_tokens=2)[0].token_ids
    assert m.engine.blocks.num_free == m.engine.blocks.num_blocks


def test_block_manager_accounting():
    """BlockManager against hand-counted blocks: ceil(tokens / block_size) allocated, all freed."""
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Sequence(list(range(6)), SamplingParams(), seed=0)
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 2 and bm.num_free == 2
    s.token_ids += [1, 2, 3]  # 9 tokens -> needs a third block
    assert bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 3
    bm.deallocate(s)
    assert bm.num_free == 4 and s.block_table == []


def test_seeded_draw_does_not_follow_the_sort_order():
    """Invariant (layers/sampler.py): a seeded draw gives each token its own noise, so two near-equal
    logits whose order a last-bit difference swaps (another layout's rounding) keep their draws: over
    random seeds and temperatures, logits with such a pair swapped sample the same tokens (a draw
    indexed by sort rank swaps them whenever it lands on either, about half the draws here)."""
    rng = np.random.default_rng()
    V, B = 16, 512
    base = rng.standard_normal(V).astype(np.float32) * 0.1
    i, j = rng.choice(V, 2, replace=False)
    a, b = base.copy(), base.copy()
    a[i], a[j] = 2.0, np.nextafter(np.float32(2.0), np.float32(3.0))
    b[i], b[j] = a[j], a[i]  # the pair's order swapped by one ulp
    seeds = jnp.asarray(rng.integers(0, 1 << 32, size=B, dtype=np.uint64).astype(np.uint32))
    pos = jnp.asarray(rng.integers(0, 4096, size=B), jnp.int32)
    temp = jnp.asarray(rng.uniform(0.5, 1.5, size=B), jnp.float32)
    ones, zeros = jnp.ones(B, jnp.float32), jnp.zeros(B, jnp.int32)
    ta = sample(jnp.broadcast_to(jnp.asarray(a), (B, V)), temp, ones, zeros, seeds, pos)[0]
    tb = sample(jnp.broadcast_to(jnp.asarray(b), (B, V)), temp, ones, zeros, seeds, pos)[0]
    on_pair = np.isin(np.asarray(ta), [i, j])
    assert on_pair.mean() > 0.3  # the pair does get drawn
    assert np.array_equal(np.asarray(ta), np.asarray(tb))


def test_untruncated_sampling_skips_the_sort_with_the_same_tokens():
    """Invariant (layers/sampler.py): a batch where no sampling row asks for top-k/top-p draws without
    the vocabulary sort (SampleMode.truncate False) and gets the tokens the sorting variant gives the
    same rows: same keys, same Gumbel-max over the vocabulary in token order. Rows mix greedy and
    sampling; the seed is printed so a failure replays."""
    from moejax.layers.sampler import SampleMode
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    B, V = 64, 257
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32) * 2)
    temp = jnp.asarray(np.where(rng.random(B) < 0.25, 0.0, rng.uniform(0.3, 1.5, B)), jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 1 << 32, size=B, dtype=np.uint64).astype(np.uint32))
    pos = jnp.asarray(rng.integers(0, 4096, size=B), jnp.int32)
    ones, zeros = jnp.ones(B, jnp.float32), jnp.zeros(B, jnp.int32)
    full = sample(logits, temp, ones, zeros, seeds, pos, SampleMode(True, False, True))
    fast = sample(logits, temp, ones, zeros, seeds, pos, SampleMode(True, False, False))
    assert np.array_equal(np.asarray(full[0]), np.asarray(fast[0]))
    np.testing.assert_array_equal(np.asarray(full[1]), np.asarray(fast[1]))
    assert len(set(np.asarray(fast[0]).tolist())) > 10  # the draws do vary
    # The mode the host picks: truncation only where a sampling row asks for it.
    assert SampleMode.of([SamplingParams(temperature=0.7)]).truncate is False
    assert SampleMode.of([SamplingParams(temperature=0.7, top_p=0.9)]).truncate is True
    assert SampleMode.of([SamplingParams(top_k=5), SamplingParams(temperature=1.0)]).truncate is False
    assert len(set(SampleMode.all())) == 7  # six without the controls, and the controls variant
