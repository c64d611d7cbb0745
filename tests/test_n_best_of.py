"""Several samples of a prompt: ``n`` and ``best_of`` (vLLM's rules, engine/parallel_sampling.py) through
``moejax.generate`` and the server. Sample j of a seeded request samples with seed + j (the same tokens as
a request of that seed alone); the prompt is prefilled once and its blocks shared through the prefix cache;
best_of returns the n of highest cumulative logprob (checked against a NumPy log-softmax of the logits);
the server's choices (index prompt * n + j), streamed with their index, usage counting every returned
choice's tokens; bad values a ValueError / 400 naming the field."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

import moejax
from moejax.tiny.checkpoint import make_random_checkpoint

from conftest import log_softmax, openai_client, serving, v3_tiny_two_layers

NAME = "tiny-n"
KW = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=16, progress=False)
SAMPLE = dict(max_new_tokens=8, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("n")), v3_tiny_two_layers(), seed=11, std=0.1)


@pytest.fixture(scope="module")
def model(path):
    return moejax.load(path, **KW)


def _cumulative(model, prompt, out):
    """The reference cumulative logprob of ``out`` after ``prompt``: float64 log-softmax of the logits."""
    ids = prompt + out  # padded at the end to one length (one score program; causal: nothing before it changes)
    lsm = log_softmax(model.score([ids + [0] * (64 - len(ids))])[0, len(prompt) - 1:len(ids) - 1])
    return float(lsm[np.arange(len(out)), out].sum())


def test_n_samples_with_seed_j_and_shared_prompt(model):
    """n = 3, seeded: sample j is the seed + j request's (tokens, logprobs); the prompt's full blocks are
    prefix-cache hits for samples 2 and 3 (prefilled once)."""
    rng = np.random.default_rng()
    prompt = rng.integers(2, 300, size=int(rng.integers(40, 70))).tolist()
    seed = int(rng.integers(1 << 30))
    hits0 = model.engine.scheduler.prefix_cache_hits
    got = moejax.generate(model, [prompt], n=3, seed=seed, logprobs=True, **SAMPLE)
    hits = model.engine.scheduler.prefix_cache_hits - hits0
    # the full blocks before the last token (a prompt cached whole still computes its last block)
    assert hits >= 2 * ((len(prompt) - 1) // 16) * 16, hits
    assert len(got) == 3 and len({tuple(r.token_ids) for r in got}) > 1
    for j, r in enumerate(got):
        alone = moejax.generate(model, [prompt], seed=seed + j, logprobs=True, **SAMPLE)[0]
        assert r.token_ids == alone.token_ids
        np.testing.assert_allclose(r.logprobs, alone.logprobs, atol=1e-5)
        np.testing.assert_allclose(r.cumulative_logprob, sum(alone.logprobs), atol=1e-4)


def test_best_of_keeps_highest_cumulative_logprob(model):
    """best_of 4, n 2 over two prompts: per prompt the two of the four samples (n=4's) with the highest
    cumulative logprob (NumPy reference), highest first, prompt-major."""
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 300, size=int(n)).tolist() for n in rng.integers(3, 30, size=2)]
    seed = int(rng.integers(1 << 30))
    all4 = moejax.generate(model, prompts, n=4, seed=seed, **SAMPLE)
    best = moejax.generate(model, prompts, n=2, best_of=4, seed=seed, **SAMPLE)
    assert len(best) == 4
    for i, p in enumerate(prompts):
        cums = [_cumulative(model, p, r.token_ids) for r in all4[i * 4:(i + 1) * 4]]
        np.testing.assert_allclose([r.cumulative_logprob for r in all4[i * 4:(i + 1) * 4]], cums, atol=1e-3)
        want = [all4[i * 4 + k].token_ids for k in np.argsort(cums)[::-1][:2]]
        assert [r.token_ids for r in best[i * 2:(i + 1) * 2]] == want


@pytest.mark.parametrize("kw,field", [({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"n": True}, "n"), ({"n": 129}, "n"),
                                      ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 0}, "best_of")])
def test_generate_refuses_bad_n(model, kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        moejax.generate(model, [[3, 4]], **kw)


# ----- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(path):
    with serving(moejax.load(path, **KW), NAME) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def test_server_n_choices_match_generate(client, model):
    """n = 3 over a list of two prompts (seeded): choice i * 3 + j is generate's sample j of prompt i (seed
    and seed + j); usage counts the prompts once and every choice's tokens."""
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 300, size=int(n)).tolist() for n in rng.integers(3, 30, size=2)]
    seed = int(rng.integers(1 << 30))
    r = client.completions.create(model=NAME, prompt=prompts, n=3, max_tokens=8, temperature=1.0, seed=seed,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == list(range(6))
    for i, p in enumerate(prompts):
        want = moejax.generate(model, [p], n=3, seed=seed, **SAMPLE)
        assert [c.model_extra["token_ids"] for c in r.choices[i * 3:(i + 1) * 3]] == [w.token_ids for w in want]
        assert [c.text for c in r.choices[i * 3:(i + 1) * 3]] == [w.text for w in want]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 6 * 8


def test_server_n_streamed_with_index(client):
    """A streamed n = 2 chat (seeded): every chunk names its choice, each choice's deltas add up to the
    non-streamed choice's text, and the usage chunk counts both choices' tokens."""
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hello"}], n=2, max_tokens=6, temperature=1.0,
              seed=int(np.random.default_rng().integers(1 << 30)), extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    texts, finish = {0: "", 1: ""}, {}
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices} and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12 == whole.usage.completion_tokens


def test_server_best_of(client, model):
    """best_of 3, n 1: the choice is generate's best of the three samples by cumulative logprob."""
    rng = np.random.default_rng()
    prompt = rng.integers(2, 300, size=12).tolist()
    seed = int(rng.integers(1 << 30))
    r = client.completions.create(model=NAME, prompt=prompt, best_of=3, max_tokens=8, temperature=1.0, seed=seed,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    samples = moejax.generate(model, [prompt], n=3, seed=seed, **SAMPLE)
    cums = [_cumulative(model, prompt, s.token_ids) for s in samples]
    assert len(r.choices) == 1 and r.choices[0].model_extra["token_ids"] == samples[int(np.argmax(cums))].token_ids
    assert r.usage.completion_tokens == 8


def test_server_n_with_echo(server, model):
    """n = 2 with echo (max_tokens 0): both choices are the prompt alone, no completion tokens counted."""
    body = {"model": NAME, "prompt": "abc", "n": 2, "echo": True, "max_tokens": 0, "logprobs": 1}
    with urllib.request.urlopen(urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                                       {"Content-Type": "application/json"}), timeout=120) as f:
        r = json.loads(f.read())
    assert [c["text"] for c in r["choices"]] == ["abc", "abc"] and r["usage"]["completion_tokens"] == 0
    assert r["choices"][0]["logprobs"] == r["choices"][1]["logprobs"]


@pytest.mark.parametrize("extra,param", [({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
                                         ({"best_of": 2, "stream": True}, "best_of"), ({"n": -1}, "n")])
def test_server_bad_n_400(server, extra, param):
    body = {"model": NAME, "prompt": "abc", "max_tokens": 2, **extra}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=60)
    err = json.loads(ei.value.read())["error"]
    assert ei.value.code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err


def test_engine_without_cumulative_or_prompt_logprobs_refused(path):
    """An engine whose sequences bring no cumulative logprob (best_of) or no prompt logprobs (echo, the
    prompt_logprobs field), as a disaggregated router's: a 400 naming the field, never a silent pick."""
    from moejax.server.protocol import APIError, Output, ServingContext, parse_request, sample_outputs
    from moejax.tokenizer import Tokenizer
    ctx = ServingContext((NAME,), Tokenizer(path), 128, 260)

    def req(**body):
        return parse_request(json.dumps({"prompt": "ab", "max_tokens": 1, **body}).encode(), ctx, False)
    bare = Output("x", [5], [-1.0], [None], "length")
    assert sample_outputs(req(n=2), [bare, bare]) == [bare, bare]
    for body, param in (({"best_of": 2}, "best_of"), ({"echo": True, "logprobs": 1}, "echo"),
                        ({"prompt_logprobs": 2}, "prompt_logprobs")):
        r = req(**body)
        with pytest.raises(APIError) as ei:
            sample_outputs(r, [bare] * r.best_of)
        assert ei.value.status == 400 and ei.value.param == param
