"""The OpenAI-compatible server, driven by the official `openai` client over a loopback port:
completions and chat (streaming and not), usage, greedy parity with moejax.generate, top logprobs
against score()'s log-softmax, 4xx errors, disconnects freeing KV blocks, 64 concurrent streams,
the step log, /health and /metrics."""

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections import deque

import numpy as np
import pytest

import moejax
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.step_log import StepLog
from moejax.server.app import ServerThread, build_app
from moejax.server.async_engine import AsyncEngine
from moejax.server.metrics import parse_metrics
from moejax.server.incremental_text import IncrementalText
from moejax.server.protocol import ServingContext
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

import openai  # noqa: E402  (in the test extra)
from conftest import assert_top_logprobs, log_softmax, openai_client, serving  # noqa: E402

NAME = "tiny-test"
MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=5, std=0.1)


def _load(path):
    return moejax.load(path, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=64, progress=False)


@pytest.fixture(scope="module")
def server(tiny_path):
    with serving(_load(tiny_path), NAME) as srv:
        openai_client(srv.url).completions.create(model=NAME, prompt="warm up", max_tokens=4, temperature=0)
        yield srv


@pytest.fixture(scope="module")
def ref(tiny_path):
    """A second copy of the model for moejax.generate references (the server's engine is its own thread's)."""
    return _load(tiny_path)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _metrics(server):
    with urllib.request.urlopen(server.url + "/metrics") as r:
        return parse_metrics(r.read().decode())


def _post_raw(server, path, data: bytes):
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat_ids(model, messages):
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_models_and_health(server, client):
    """/v1/models lists exactly the served name; /health answers 200."""
    assert [m.id for m in client.models.list().data] == [NAME]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200


def test_completion_greedy_matches_generate(client, ref):
    """Greedy /v1/completions (plain and streamed) against moejax.generate on a second copy of the
    model: same text, token ids and logprobs (1e-4); usage counts the tokenizer's prompt length."""
    prompt = "The capital of France is"
    want = moejax.generate(ref, [prompt], max_new_tokens=12, ignore_eos=True, logprobs=True)[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ch = r.choices[0]
    assert ch.text == want.text and ch.finish_reason == "length"
    assert ch.model_extra["token_ids"] == want.token_ids
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert len(ch.logprobs.tokens) == 12
    np.testing.assert_allclose(ch.logprobs.token_logprobs, want.logprobs, rtol=1e-4, atol=1e-4)

    # streaming: the same text, one chunk per token, usage in the last chunk
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    tok_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in tok_chunks) == want.text
    assert [t for c in tok_chunks for t in c.choices[0].model_extra["token_ids"]] == want.token_ids
    assert tok_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_token_id_prompt(client, ref):
    """A token-id prompt: usage counts it as is, greedy output ids equal moejax.generate's."""
    ids = np.random.default_rng().integers(2, 300, size=37).tolist()
    want = moejax.generate(ref, [ids], max_new_tokens=8, ignore_eos=True)[0]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.prompt_tokens == 37 and r.choices[0].model_extra["token_ids"] == want.token_ids


def test_chat_greedy_matches_generate(client, ref):
    """Greedy /v1/chat/completions (plain and streamed) against moejax.generate on the chat template's
    token ids: same text and logprobs (1e-4), role assistant, usage counts."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    ids = _chat_ids(ref, msgs)
    want = moejax.generate(ref, [ids], max_new_tokens=10, ignore_eos=True, logprobs=True)[0]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    np.testing.assert_allclose([c.logprob for c in r.choices[0].logprobs.content], want.logprobs, rtol=1e-4,
                               atol=1e-4)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 10


def _ref_log_softmax(model, prompt_ids, out_ids):
    """Reference logprobs of each output position: NumPy log-softmax of score() over prompt + output."""
    return log_softmax(model.score([prompt_ids + out_ids])[0, len(prompt_ids) - 1:-1])


def _token_id(token: str) -> int:
    assert token.startswith("token_id:"), token  # vLLM's return_tokens_as_token_ids rendering
    return int(token.removeprefix("token_id:"))


def test_completion_top_logprobs(client, ref):
    """Completions logprobs=N (random 1..20), greedy: each token's top_logprobs against a NumPy log-softmax of
    score() over prompt + output (ids through return_tokens_as_token_ids), the greedy token first; with token
    strings, each key holds the best logprob of the ids it renders; streamed chunks carry the same entries."""
    rng = np.random.default_rng()
    n = int(rng.integers(1, 21))
    prompt = rng.integers(2, 300, size=8).tolist()
    kw = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=n)
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    lp = client.completions.create(**kw, extra_body=as_ids).choices[0].logprobs
    out = [_token_id(t) for t in lp.tokens]
    lsm = _ref_log_softmax(ref, prompt, out)
    np.testing.assert_allclose(lp.token_logprobs, lsm[np.arange(len(out)), out], atol=1e-4)
    tops = [[(_token_id(k), v) for k, v in d.items()] for d in lp.top_logprobs]
    assert len(tops) == len(out) == 8
    for pos, top in enumerate(tops):
        assert_top_logprobs(top, lsm[pos], n)
        assert top[0] == (out[pos], lp.token_logprobs[pos])

    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert plain.tokens == [ref.tokenizer.decode([t], skip_special_tokens=False) for t in out]
    for d, top in zip(plain.top_logprobs, tops):
        want = {}
        for i, v in top:
            want.setdefault(ref.tokenizer.decode([i], skip_special_tokens=False), v)
        assert list(d) == list(want)
        np.testing.assert_allclose(list(d.values()), list(want.values()), atol=1e-6)

    chunks = [c for c in client.completions.create(**kw, stream=True, extra_body=as_ids) if c.choices]
    streamed = [d for c in chunks if c.choices[0].logprobs for d in c.choices[0].logprobs.top_logprobs]
    assert [list(d) for d in streamed] == [list(d) for d in lp.top_logprobs]
    np.testing.assert_allclose([v for d in streamed for v in d.values()],
                               [v for d in lp.top_logprobs for v in d.values()], atol=1e-6)


def test_chat_top_logprobs(client, ref):
    """Chat logprobs with top_logprobs=N (random 1..20), seeded sampling: each content entry's top_logprobs
    ({token, logprob, bytes}) against a NumPy log-softmax of score(); the sampled token's logprob equals its
    entry when it is among them; the stream (same seed) carries the same entries."""
    rng = np.random.default_rng()
    n = int(rng.integers(1, 21))
    msgs = [{"role": "user", "content": "Tell me something."}]
    ids = _chat_ids(ref, msgs)
    kw = dict(model=NAME, messages=msgs, max_tokens=6, temperature=0.8, seed=int(rng.integers(1 << 30)),
              logprobs=True, top_logprobs=n, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    out = [_token_id(c.token) for c in content]
    lsm = _ref_log_softmax(ref, ids, out)
    assert len(out) == 6
    for pos, c in enumerate(content):
        np.testing.assert_allclose(c.logprob, lsm[pos, out[pos]], atol=1e-4)
        top = [(_token_id(t.token), t.logprob) for t in c.top_logprobs]
        assert_top_logprobs(top, lsm[pos], n)
        assert all(t.bytes == list(t.token.encode()) for t in [c, *c.top_logprobs])
        if out[pos] in dict(top):
            assert dict(top)[out[pos]] == c.logprob
    streamed = [e for ch in client.chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in c.top_logprobs]
                                                                     for c in content]
    # float32 logprobs move ~1e-7-2e-6 with the batch the request lands in (its bucket's padding; XLA:CPU's
    # buckets are powers of 4 since 2026-12-07f): the same tokens, the values to 1e-5 (the reference's 1e-4)
    np.testing.assert_allclose([t.logprob for e in streamed for t in e.top_logprobs],
                               [t.logprob for c in content for t in c.top_logprobs], atol=1e-5)


def test_stop_string_never_streamed(client, ref):
    """A stop string taken from moejax.generate's output: the server returns (and streams) exactly the
    text before it, never the stop string, finish "stop"."""
    prompt = "Once upon a time"
    full = moejax.generate(ref, [prompt], max_new_tokens=40, ignore_eos=True)[0].text
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip()]
    if not clean:
        pytest.skip("no usable stop string in the random model's output")
    stop = full[clean[0]:clean[0] + 2]
    want = full[:full.find(stop)]
    kw = dict(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_incremental_text_holds_back_stop_prefixes():
    """IncrementalText against hand-worked cases: text that could start a stop string is held back
    until it cannot, and the cut stop string is never emitted."""
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    d = IncrementalText(Tok(), ["xyz"])
    assert d.add(ord("a")) == "a"
    assert d.add(ord("x")) == ""  # could start "xyz"
    assert d.add(ord("b")) == "xb"
    assert d.add(ord("x")) == "" and d.add(ord("y")) == ""
    assert d.finish("axb") == ""  # the engine cut the stop string


def test_bad_inputs_get_openai_errors(server, client):
    """Invariant: each bad request gets an OpenAI-shaped 4xx error naming the offending param; the
    server keeps serving afterwards."""
    status, body = _post_raw(server, "/v1/completions", b'{"prompt": "hi", ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = _post_raw(server, "/v1/completions", b'[1, 2]')
    assert status == 400

    def expect(exc, param, fn, **kw):
        with pytest.raises(exc) as ei:
            fn(**kw)
        err = ei.value.body if isinstance(ei.value.body, dict) and "message" in ei.value.body else None
        assert err is not None, ei.value.body
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        return err

    comp, chat = client.completions.create, client.chat.completions.create
    base = dict(model=NAME, prompt="hello", max_tokens=4)
    expect(openai.NotFoundError, "model", comp, **{**base, "model": "no-such-model"})
    expect(openai.BadRequestError, "prompt", comp, **{**base, "prompt": "x" * (MAX_LEN + 10)})
    expect(openai.BadRequestError, "prompt", comp, **{**base, "prompt": [5] * MAX_LEN})
    expect(openai.BadRequestError, "max_tokens", comp, **{**base, "max_tokens": -1})
    expect(openai.BadRequestError, "max_tokens", comp, **{**base, "max_tokens": 0})
    expect(openai.BadRequestError, "max_tokens", comp, **{**base, "max_tokens": 10**9})
    expect(openai.BadRequestError, "max_tokens", comp, **{**base, "max_tokens": "ten"})
    expect(openai.BadRequestError, "temperature", comp, **{**base, "temperature": "hot"})
    expect(openai.BadRequestError, "temperature", comp, **{**base, "temperature": -1})
    expect(openai.BadRequestError, "top_p", comp, **{**base, "top_p": 0})
    expect(openai.BadRequestError, "seed", comp, **{**base, "seed": 1.5})
    expect(openai.BadRequestError, "stop", comp, **{**base, "stop": 7})
    expect(openai.BadRequestError, "prompt", comp, **{**base, "prompt": 3.5})
    expect(openai.BadRequestError, "prompt", comp, **{**base, "prompt": [1, 2, 100000]})
    expect(openai.BadRequestError, "prompt", comp, **{**base, "prompt": ["a", "b"], "stream": True})
    expect(openai.BadRequestError, "n", comp, **{**base, "n": 0})
    expect(openai.BadRequestError, "ignore_eos", comp, **base, extra_body={"ignore_eos": "yes"})
    expect(openai.BadRequestError, "stream_options", comp, **base, stream_options={"include_usage": True})
    expect(openai.BadRequestError, "messages", chat, model=NAME, messages=[])
    expect(openai.BadRequestError, "messages", chat, model=NAME, messages="hi")
    expect(openai.BadRequestError, "messages", chat, model=NAME, messages=[{"role": "robot", "content": "x"}])
    expect(openai.BadRequestError, "n", chat, model=NAME, messages=[{"role": "user", "content": "x"}], n=129)
    # the server is still fine
    assert client.completions.create(**base).usage.completion_tokens >= 1
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200


def test_disconnect_mid_stream_frees_blocks(server, client):
    """Invariant: a client closing a stream mid-way aborts its request (counted once, not as a
    success) and every KV block is free again."""
    before = _metrics(server)
    stream = client.completions.create(model=NAME, prompt="a long story", max_tokens=MAX_LEN - 20, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = _metrics(server)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
                and m["moejax:request_aborted_total"] > before["moejax:request_aborted_total"]):
            break
        time.sleep(0.05)
    assert m["moejax:request_aborted_total"] == before["moejax:request_aborted_total"] + 1
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:request_success_total"] == before["vllm:request_success_total"]  # aborts are no success
    assert server.aengine.engine.blocks.num_free == server.aengine.engine.blocks.num_blocks


def test_disconnect_non_streaming_aborts_and_frees_blocks(server):
    """Invariant: a non-streaming client that times out while its tokens are still coming (its connection
    closed) has its request aborted, not run to the end: counted as an abort, no success, every KV block
    free again. The client waits for the request's first decoded tokens before its read times out: the
    handler then sees events, not a quiet wait (the same request run once before: no compile pauses them)."""
    body = json.dumps({"model": NAME, "prompt": "a long story", "max_tokens": MAX_LEN - 20, "temperature": 0,
                       "ignore_eos": True}).encode()
    status, full = _post_raw(server, "/v1/completions", body)
    assert status == 200 and full["usage"]["completion_tokens"] == MAX_LEN - 20
    before = _metrics(server)
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n".encode()
                 + b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    engine = server.aengine.engine
    deadline = time.time() + 60
    while not any(len(s.output_ids) >= 2 for s in list(engine.scheduler.running)):
        assert time.time() < deadline, "the request never started decoding"
        time.sleep(0.01)
    sock.settimeout(0.01)
    with pytest.raises(socket.timeout):
        sock.recv(1)  # the client's read timeout (short: the rest of the request takes ~0.3 s): it gives up
    sock.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = _metrics(server)
        ended = (m["moejax:request_aborted_total"] > before["moejax:request_aborted_total"]
                 or m["vllm:request_success_total"] > before["vllm:request_success_total"])
        if ended and m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.05)
    assert m["moejax:request_aborted_total"] == before["moejax:request_aborted_total"] + 1
    assert m["vllm:request_success_total"] == before["vllm:request_success_total"]  # it did not run to its end
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_64_concurrent_streams(server, ref):
    """64 concurrent greedy streams against one batched moejax.generate: each stream's ids are its
    reference's prefix, text is their decode, usage right; decode steps were batched and never mixed."""
    # A fixed draw: the server batches these differently from the reference's one batch, where a
    # greedy near-tie could flip a token; this draw is known to pass.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 300, size=int(rng.integers(4, 40))).tolist() for _ in range(64)]
    n_out = [int(x) for x in rng.integers(8, 24, size=64)]
    want = [r.token_ids for r in moejax.generate(ref, prompts, max_new_tokens=max(n_out), ignore_eos=True)]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    steps_before = len(server.aengine.step_log)

    async def one(i):
        ids, text, usage = [], "", None
        stream = await aclient.completions.create(model=NAME, prompt=prompts[i], max_tokens=n_out[i], temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True, "return_token_ids": True})
        async for c in stream:
            if c.choices:
                ids += c.choices[0].model_extra["token_ids"]
                text += c.choices[0].text
            if c.usage:
                usage = c.usage
        return ids, text, usage

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    for i, (ids, text, usage) in enumerate(results):
        assert ids == want[i][:n_out[i]], i
        assert text == ref.tokenizer.decode(ids)
        assert usage.completion_tokens == n_out[i] and usage.prompt_tokens == len(prompts[i])
    log = list(server.aengine.step_log)[steps_before:]
    assert max(len(r.seq_ids) for r in log if r.kind == "decode") > 1  # they were batched
    assert all(r.is_pure for r in log) and server.aengine.step_log.mixed_steps == 0


def test_prefill_never_shares_a_step_with_decodes(ref):
    """Requests arriving while others decode: every step is all-prefill or all-decode."""
    eng, log = ref.engine, StepLog()
    rng = np.random.default_rng()
    seqs, arrivals = [], deque(range(12))
    prefill_while_running = 0
    while arrivals or any(not s.is_finished for s in seqs):
        if arrivals and rng.random() < 0.5:
            arrivals.popleft()
            seqs.append(eng.add_request(rng.integers(2, 300, size=int(rng.integers(3, 30))).tolist(),
                                        SamplingParams(max_new_tokens=int(rng.integers(3, 12)), ignore_eos=True)))
        running = len(eng.scheduler.running)
        kind, _ = log.step(eng)
        prefill_while_running += kind == "prefill" and running > 0
    kinds = {r.kind for r in log}
    assert kinds == {"prefill", "decode"} and prefill_while_running > 0
    assert all(r.is_pure for r in log) and log.mixed_steps == 0
    assert all(r.from_running == 0 for r in log if r.kind == "prefill")
    assert all(r.from_waiting == 0 for r in log if r.kind == "decode")


def test_metrics_have_vllm_names(server, client):
    """/metrics carries vLLM's metric names; one 6-token request moves the counters by exactly its
    counts (6 generated, 5 decode tokens and ITLs, its prompt tokens, one success / TTFT / e2e)."""
    before = _metrics(server)
    resp = client.completions.create(model=NAME, prompt="metrics", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    for name in ["vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:num_preemptions_total", "vllm:request_success_total", "moejax:decode_tokens_total",
                 "moejax:decode_time_seconds_total", "moejax:decode_throughput_tokens_per_second"]:
        assert name in text, name
    m = parse_metrics(text)
    assert m["vllm:generation_tokens_total"] >= 6 and m["vllm:request_success_total"] >= 1
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["moejax:decode_tokens_total"] > 0 and m["moejax:decode_throughput_tokens_per_second"] > 0
    assert m["moejax:mixed_steps_total"] == 0
    delta = {k: m[k] - before[k] for k in before if k in m}
    assert delta["vllm:generation_tokens_total"] == 6 and delta["vllm:request_success_total"] == 1
    assert delta["vllm:prompt_tokens_total"] == resp.usage.prompt_tokens
    assert delta["vllm:time_to_first_token_seconds_count"] == 1 and delta["vllm:e2e_request_latency_seconds_count"] == 1
    assert delta["vllm:inter_token_latency_seconds_count"] == 5 and delta["moejax:decode_tokens_total"] == 5


class _DyingEngine:
    """Accepts requests; its first step raises."""

    class _Sched:
        def __init__(self):
            self.waiting, self.running, self.num_preemptions = deque(), [], 0

    class _Blocks:
        usage, num_free, num_blocks = 0.0, 1, 1

    def __init__(self):
        from moejax.engine.llm_engine import EngineStats
        self.scheduler, self.blocks, self.stats, self.n = self._Sched(), self._Blocks(), EngineStats(), 0

    def add_request(self, ids, params):
        from moejax.engine.sequence import Sequence
        self.n += 1
        return Sequence(ids, params, 0)

    def has_unfinished(self):
        return self.n > 0

    def step(self):
        raise RuntimeError("boom")

    def abort(self, seq):
        pass


def test_health_503_once_engine_dead(ref):
    """Invariant: once the engine thread dies, /health and every request answer 503, and the server stays up."""
    aengine = AsyncEngine(_DyingEngine(), "dying").start()
    ctx = ServingContext(("dying",), ref.tokenizer, MAX_LEN, ref.config.model.vocab_size)
    srv = ServerThread(app=build_app(aengine, ctx)).start()
    try:
        with urllib.request.urlopen(srv.url + "/health") as r:
            assert r.status == 200
        c = openai_client(srv.url, timeout=30)
        with pytest.raises(openai.APIStatusError) as ei:
            c.completions.create(model="dying", prompt="hi", max_tokens=4)
        assert ei.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(srv.url + "/health")
        assert he.value.code == 503
        with pytest.raises(openai.APIStatusError) as ei:  # later requests are refused, the server stays up
            c.completions.create(model="dying", prompt="hi", max_tokens=4)
        assert ei.value.status_code == 503
    finally:
        srv.stop()
        aengine.shutdown()
