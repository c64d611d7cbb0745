"""Prompt logprobs from the prefill (vLLM's ``prompt_logprobs``; completions' ``echo`` with ``logprobs``, the
layout lm-eval's local-completions parses) against HF transformers' float32 logits of the same tiny
checkpoint: whole prompts packed, a prompt chunked over a small prefill budget (paged chunks), a prompt
already in the prefix cache (computed again, not read), top-k and ranks; ``moejax.generate`` and the server
(echo with max_tokens 0 and 1, lists of prompts, the prompt_logprobs field, chat's top-level one), and
their 400s."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

import moejax

from conftest import assert_top_logprobs, log_softmax, serving, v3_tiny_two_layers

NAME = "tiny-echo"
MAX_LEN = 128
PREFILL_BUDGET = 48  # a prompt longer than this is prefilled in chunks (the paged program)


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
    d = str(tmp_path_factory.mktemp("echo"))
    return d, make_hf_checkpoint(d, v3_tiny_two_layers(initializer_range=0.1), seed=3)


@pytest.fixture(scope="module")
def model(hf_tiny):
    return moejax.load(hf_tiny[0], dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8, progress=False,
                       max_prefill_tokens=PREFILL_BUDGET)


def _ref(hf, ids) -> np.ndarray:
    """float64 log-softmax of HF's float32 logits of one prompt [T, V]."""
    with torch.no_grad():
        return log_softmax(hf(torch.tensor([ids])).logits.float().numpy()[0])


def _check_prompt(prompt, entries, lsm, k):
    """``entries``: vLLM's layout (None, then {token id: logprob} with the token first, then its top k)."""
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, (tok, d) in enumerate(zip(prompt[1:], entries[1:])):
        ref_row = lsm[pos]
        items = list(d.items())
        assert items[0][0] == tok
        np.testing.assert_allclose(items[0][1], ref_row[tok], atol=1e-4)
        alts = items[1:] if k else []
        if k:  # the token may be one of its own alternatives: the dict holds it once
            top = [(i, lp) for i, lp in items if i != tok or ref_row[tok] >= np.sort(ref_row)[::-1][k - 1] - 1e-5]
            assert_top_logprobs(sorted(top, key=lambda x: -x[1])[:k], ref_row, k)
        else:
            assert not alts


def test_generate_prompt_logprobs_match_hf(model, hf_tiny):
    """Prompts of random lengths (1, short, over the prefill budget: chunked) with prompt_logprobs k random
    in 1..20, one with 0 (the token's own only), one prompt given twice (the second would hit the prefix
    cache): each prompt token's logprob and top k against HF's float32 log-softmax (atol 1e-4)."""
    hf = hf_tiny[1]
    rng = np.random.default_rng()
    V = model.config.model.vocab_size
    lens = [1, int(rng.integers(2, 20)), int(rng.integers(PREFILL_BUDGET + 5, 100))]
    prompts = [rng.integers(2, V, size=n).tolist() for n in lens]
    k = int(rng.integers(1, 21))
    for kk in (k, 0):
        out = moejax.generate(model, prompts, max_new_tokens=2, prompt_logprobs=kk)
        for p, r in zip(prompts, out):
            _check_prompt(p, r.prompt_logprobs, _ref(hf, p), kk)
    again = moejax.generate(model, [prompts[2]], max_new_tokens=1, prompt_logprobs=k)[0]
    _check_prompt(prompts[2], again.prompt_logprobs, _ref(hf, prompts[2]), k)
    assert moejax.generate(model, prompts[:1], max_new_tokens=1)[0].prompt_logprobs is None


def test_prompt_logprob_ranks(model, hf_tiny):
    """Each prompt token's rank (1 + the tokens more likely) against the reference's."""
    rng = np.random.default_rng()
    prompt = rng.integers(2, model.config.model.vocab_size, size=30).tolist()
    seq = model.engine.add_request(prompt, moejax.SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    model.engine.run_to_completion([seq])
    lsm = _ref(hf_tiny[1], prompt)
    want = [int(np.sum(lsm[p] > lsm[p, t] + 1e-5)) + 1 for p, t in enumerate(prompt[1:])]
    got = [e.rank for e in seq.prompt_logprobs]
    assert len(got) == len(want) and all(abs(g - w) <= 1 for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_generate_refuses_bad_prompt_logprobs(model, bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        moejax.generate(model, [[3, 4]], prompt_logprobs=bad)


# ----- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model):
    with serving(model, NAME) as srv:
        yield srv


def _post(server, path, body):
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_layout_lm_eval_parses(server, model, hf_tiny, max_tokens):
    """lm-eval's loglikelihood request (echo, logprobs 1, temperature 0) over a list of token-id prompts:
    token_logprobs None first, then each prompt token's logprob (HF's), the generated one after when
    max_tokens 1; tokens, top_logprobs (the most likely: lm-eval's is_greedy), text_offset; text echoes the
    prompt; usage counts the generated tokens only."""
    rng = np.random.default_rng()
    V = model.config.model.vocab_size
    prompts = [rng.integers(2, V, size=int(n)).tolist() for n in rng.integers(2, 40, size=3)]
    status, body = _post(server, "/v1/completions", {"model": NAME, "prompt": prompts, "echo": True, "logprobs": 1,
                                                     "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    tok = model.tokenizer
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for p, c in zip(prompts, body["choices"]):
        lp = c["logprobs"]
        n = len(p) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        lsm = _ref(hf_tiny[1], p)
        np.testing.assert_allclose(lp["token_logprobs"][1:len(p)], lsm[np.arange(len(p) - 1), p[1:]], atol=1e-4)
        for pos in range(1, len(p)):
            top = lp["top_logprobs"][pos]
            # vLLM's layout: the prompt token first, then the N best without it (N + 1 entries at most); two
            # ids of one text (the byte tokenizer's lone high bytes) share one key
            best = int(np.argmax(lsm[pos - 1]))
            same = p[pos] == best or tok.decode([p[pos]], skip_special_tokens=False) == tok.decode(
                [best], skip_special_tokens=False)
            assert len(top) == (1 if same else 2) and next(iter(top)) == lp["tokens"][pos], (pos, top)
            vals = list(top.values())
            np.testing.assert_allclose(vals[0], lp["token_logprobs"][pos], atol=1e-6)
            if p[pos] == best or not same:  # the best one is there (not hidden under the token's key)
                np.testing.assert_allclose(max(vals), lsm[pos - 1].max(), atol=1e-4)
                # lm-eval's is_greedy: the token's logprob is the top one exactly when it is the argmax
                assert (lp["token_logprobs"][pos] == max(vals)) == (p[pos] == best)
        assert lp["tokens"][:len(p)] == [tok.decode([t], skip_special_tokens=False) for t in p]
        assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
        echoed = tok.decode(p, skip_special_tokens=False)  # vLLM's echo of token ids
        assert c["text"].startswith(echoed)
        if max_tokens:
            np.testing.assert_allclose(lp["token_logprobs"][-1], lsm[-1].max(), atol=1e-4)  # greedy
        else:
            assert c["text"] == echoed and c["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 * max_tokens
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_echo_string_prompt_and_prompt_logprobs_field(server, model, hf_tiny):
    """A string prompt echoed as given; vLLM's prompt_logprobs field (None, then {id: {logprob, rank,
    decoded_token}} with the prompt token and its top k), on completions and, top-level, on chat."""
    tok = model.tokenizer
    text = "the quick brown fox"
    ids = tok.encode(text)
    lsm = _ref(hf_tiny[1], ids)
    status, body = _post(server, "/v1/completions", {"model": NAME, "prompt": text, "echo": True, "max_tokens": 2,
                                                     "temperature": 0, "prompt_logprobs": 3})
    assert status == 200, body
    c = body["choices"][0]
    assert c["text"].startswith(text) and c["logprobs"] is None
    _check_vllm_prompt_logprobs(c["prompt_logprobs"], ids, lsm, 3, tok)

    messages = [{"role": "user", "content": "hello"}]
    status, body = _post(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 1,
                                                          "prompt_logprobs": 2})
    assert status == 200, body
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    _check_vllm_prompt_logprobs(body["prompt_logprobs"], chat_ids, _ref(hf_tiny[1], chat_ids), 2, tok)


def _check_vllm_prompt_logprobs(entries, ids, lsm, k, tok):
    assert entries[0] is None and len(entries) == len(ids)
    for pos, (t, d) in enumerate(zip(ids[1:], entries[1:])):
        first_id, first = next(iter(d.items()))
        assert int(first_id) == t and first["decoded_token"] == tok.decode([t], skip_special_tokens=False)
        np.testing.assert_allclose(first["logprob"], lsm[pos, t], atol=1e-4)
        assert abs(first["rank"] - (int(np.sum(lsm[pos] > lsm[pos, t] + 1e-5)) + 1)) <= 1  # a near-tie either way
        tops = sorted(((int(i), e) for i, e in d.items() if e["rank"] <= k), key=lambda x: x[1]["rank"])
        assert [e["rank"] for _, e in tops][:k] == list(range(1, k + 1))
        assert_top_logprobs([(i, e["logprob"]) for i, e in tops[:k]], lsm[pos], k)


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_echo_requests_get_400(server, body, param):
    status, err = _post(server, "/v1/completions", {"model": NAME, "prompt": "abc", **body})
    assert status == 400 and err["error"]["param"] == param, err


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_streamed(server, max_tokens):
    """A streamed echo (n = 2, logprobs 1, greedy): each choice's chunks start with its prompt and add up to
    the whole response's text and logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""
    body = {"model": NAME, "prompt": "hello world", "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0, "n": 2}
    status, whole = _post(server, "/v1/completions", body)
    assert status == 200, whole
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    got = {i: {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for i in (0, 1)}
    finish = {}
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                g = got[c["index"]]
                if not g["text"]:
                    assert c["text"].startswith("hello world")
                g["text"] += c["text"]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    g[k] += (c["logprobs"] or {}).get(k, [])
                finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    for c in whole["choices"]:
        g = got[c["index"]]
        assert g["text"] == c["text"] and finish[c["index"]] == c["finish_reason"]
        assert g["tokens"] == c["logprobs"]["tokens"] and g["text_offset"] == c["logprobs"]["text_offset"]
        assert [list(d) if d else d for d in g["top_logprobs"]] == [
            list(d) if d else d for d in c["logprobs"]["top_logprobs"]]
        np.testing.assert_allclose([x if x is not None else np.nan for x in g["token_logprobs"]],
                                   [x if x is not None else np.nan for x in c["logprobs"]["token_logprobs"]], atol=1e-5)


def test_prompt_logprobs_over_dp_ranks(model, hf_tiny):
    """On a dp2-ep2 mesh (each rank its own prompts, the loop inside shard_map): HF's prompt logprobs and
    top k for three prompts spread over the two ranks."""
    mesh_model = moejax.load(hf_tiny[0], dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4, progress=False,
                             parallel="dp2-ep2")
    rng = np.random.default_rng()
    V = model.config.model.vocab_size
    prompts = [rng.integers(2, V, size=int(n)).tolist() for n in rng.integers(2, 40, size=3)]
    eng = mesh_model.engine
    seqs = [eng.add_request(p, moejax.SamplingParams(max_new_tokens=1, prompt_logprobs=4)) for p in prompts]
    eng.run_to_completion(seqs)
    assert {s.dp_rank for s in seqs} == {0, 1}
    for p, s in zip(prompts, seqs):
        lsm = _ref(hf_tiny[1], p)
        assert len(s.prompt_logprobs) == len(p) - 1
        for pos, e in enumerate(s.prompt_logprobs):
            np.testing.assert_allclose(e.logprob, lsm[pos, p[pos + 1]], atol=1e-4)
            assert_top_logprobs(e.top, lsm[pos], 4)
