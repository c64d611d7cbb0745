"""The server under faults and hostile input: an engine step that raises, an engine that dies,
graceful shutdown (in process and by SIGTERM to scripts/serve.py), strict validation (non-finite
numbers, unbounded integers, lone surrogates, deep JSON, 405/413/415), the access policy (API key,
Host, CORS), logprobs bounds, prompt length checked before tokenising, the KV-capacity check
at start-up and one-line errors for corrupt checkpoint files."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque

import numpy as np
import pytest

import moejax
from moejax.engine.llm_engine import EngineStats
from moejax.engine.sequence import Sequence, Status
from moejax.server.access import AccessPolicy
from moejax.server.app import ServerThread, build_app, make_app
from moejax.server.async_engine import AsyncEngine
from moejax.server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S, EXIT_AFTER_DRAIN_S
from moejax.server.metrics import parse_metrics
from moejax.server.protocol import ServingContext
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

from conftest import serving

NAME = "tiny-faults"
MAX_LEN = 256
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=7, std=0.1)


@pytest.fixture(scope="module")
def model(tiny_path):
    return moejax.load(tiny_path, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8, progress=False)


@pytest.fixture(scope="module")
def server(model):
    with serving(model, NAME) as srv:
        _post(srv.url, "/v1/completions", {"prompt": "warm", "max_tokens": 3})
        yield srv


# ----- HTTP helpers (urllib: full control over headers and raw bodies) --------------------------

def _request(url, path, data=None, headers=None, method=None):
    """(status, headers, body bytes) of one request; never raises on an HTTP error status."""
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url + path, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _post(url, path, body: dict, **kw):
    status, hdrs, raw = _request(url, path, json.dumps(body).encode(), **kw)
    return status, json.loads(raw) if raw.startswith(b"{") else raw


def _sse_events(raw: bytes) -> list:
    """The data payloads of an SSE body: dicts, and the string "[DONE]"."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_error(status, body, want_status, param=None):
    assert status == want_status, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body


def _health(url) -> int:
    return _request(url, "/health")[0]


# ----- validation -------------------------------------------------------------------------

def test_numbers_must_be_finite_and_bounded(server):
    """Non-finite floats, integers past what the kernels take (top_k 2**40 used to kill the engine),
    negative / huge seeds and out-of-range token ids: 400 naming the field; the server stays healthy."""
    rng = np.random.default_rng()
    url = server.url
    base = {"prompt": "hello", "max_tokens": 3}
    cases = [
        ({"top_k": 2 ** int(rng.integers(31, 62))}, "top_k"),
        ({"top_k": -int(rng.integers(2, 1000))}, "top_k"),
        ({"seed": 2 ** int(rng.integers(64, 90))}, "seed"),
        ({"seed": -int(rng.integers(1, 1000))}, "seed"),
        ({"max_tokens": 2 ** int(rng.integers(40, 70))}, "max_tokens"),
        ({"stop_token_ids": [2 ** int(rng.integers(40, 70))]}, "stop_token_ids"),
        ({"logprobs": int(rng.integers(21, 10**6))}, "logprobs"),
        ({"n": 2 ** int(rng.integers(40, 70))}, "n"),
        ({"top_k": True}, "top_k"),
    ]
    for extra, param in cases:
        status, body = _post(url, "/v1/completions", {**base, **extra})
        _assert_error(status, body, 400, param)
    for field in ("temperature", "top_p"):  # NaN / Infinity are not JSON, but Python's json writes them
        for lit in ("NaN", "Infinity", "-Infinity"):
            raw = json.dumps(base)[:-1] + f', "{field}": {lit}}}'
            status, _, body = _request(url, "/v1/completions", raw.encode())
            _assert_error(status, json.loads(body), 400, field)
    status, body = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "top_k": 2**40})
    _assert_error(status, body, 400, "top_k")
    assert _health(url) == 200
    status, body = _post(url, "/v1/completions", {**base, "top_k": int(rng.integers(1, 50))})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_strings_unicode_and_json_depth(server):
    """Lone surrogates in a prompt, a chat message or a stop string, and deeply nested JSON: 400, not 500."""
    url = server.url
    rng = np.random.default_rng()
    sur = "\\u%04x" % int(rng.integers(0xD800, 0xE000))
    for path, raw in [
        ("/v1/completions", '{"prompt": "ab%scd", "max_tokens": 2}' % sur),
        ("/v1/completions", '{"prompt": "ab", "stop": ["%s"], "max_tokens": 2}' % sur),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi %s"}]}' % sur),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}'
         % sur),
    ]:
        status, _, body = _request(url, path, raw.encode())
        _assert_error(status, json.loads(body), 400)
    depth = int(rng.integers(1000, 100_000))
    for raw in ['{"prompt": ' + "[" * depth + "]" * depth + "}", "[" * depth + "]" * depth,
                '{"prompt": "x", "extra": ' + '{"a": ' * depth + "1" + "}" * depth + "}"]:
        status, _, body = _request(url, "/v1/completions", raw.encode())
        _assert_error(status, json.loads(body), 400)
    # a valid astral character (a surrogate *pair*) is fine
    status, body = _post(url, "/v1/completions", {"prompt": "smile \U0001F600", "max_tokens": 2})
    assert status == 200


def test_unknown_fields_refused(server):
    """Unknown fields are refused with a 400 naming them, never ignored (vLLM ignores them with a warning:
    a client then gets output that silently disregards what it asked for); the server keeps serving."""
    key = f"no_such_field_{np.random.default_rng().integers(1 << 30)}"
    status, body = _post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True,
                                                         key: [1, {"a": 2}]})
    _assert_error(status, body, 400, key)
    status, body = _post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_logprobs_bounds_and_empty_alternatives(server):
    """logprobs N (completions) / top_logprobs N (chat) above 20: 400 naming the field; top_logprobs without
    logprobs: true: 400; N = 0 gives the sampled tokens' logprobs with empty alternatives, never null."""
    rng = np.random.default_rng()
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for n in (21, int(rng.integers(22, 10**6))):
        status, body = _post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": n})
        _assert_error(status, body, 400, "logprobs")
        status, body = _post(server.url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": n})
        _assert_error(status, body, 400, "top_logprobs")
    status, body = _post(server.url, "/v1/chat/completions", {**chat, "top_logprobs": int(rng.integers(1, 21))})
    _assert_error(status, body, 400, "top_logprobs")
    status, body = _post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 0})
    lp = body["choices"][0]["logprobs"]
    assert status == 200 and len(lp["token_logprobs"]) == 3 and lp["top_logprobs"] == [{}, {}, {}]
    for extra in ({}, {"top_logprobs": 0}):
        status, body = _post(server.url, "/v1/chat/completions", {**chat, "logprobs": True, **extra})
        content = body["choices"][0]["logprobs"]["content"]
        assert status == 200 and len(content) == 2 and all(c["top_logprobs"] == [] for c in content)


def test_methods_media_types_and_sizes(model):
    """405 with an Allow header; POST without application/json: 415; a body over the limit: 413; a
    prompt longer than max_model_len tokens could ever hold: 400 at once, before any tokenising."""
    aengine = AsyncEngine(model.engine, NAME)  # not started: none of these reaches the engine
    ctx = ServingContext((NAME,), model.tokenizer, MAX_LEN, model.config.model.vocab_size)
    srv = ServerThread(app=build_app(aengine, ctx, AccessPolicy(bind_host="127.0.0.1"), max_body_bytes=1 << 20))
    srv.start()
    try:
        for path, method in [("/v1/completions", "GET"), ("/v1/chat/completions", "PUT"), ("/health", "POST"),
                             ("/v1/models", "DELETE")]:
            status, hdrs, body = _request(srv.url, path, b"{}" if method in ("POST", "PUT") else None,
                                          method=method)
            assert status == 405, (path, method, status)
            assert "Allow" in hdrs and json.loads(body)["error"]["code"] == 405
        status, _, body = _request(srv.url, "/v1/completions", b'{"prompt": "hi"}',
                                   headers={"Content-Type": "text/plain"})
        _assert_error(status, json.loads(body), 415)
        big = json.dumps({"prompt": "a" * ((1 << 20) + 10)}).encode()
        status, _, body = _request(srv.url, "/v1/completions", big)
        _assert_error(status, json.loads(body), 413)
        long_prompt = "".join(np.random.default_rng().choice(list("abc def"), MAX_LEN * 25))
        t0 = time.perf_counter()
        status, body = _post(srv.url, "/v1/completions", {"prompt": long_prompt, "max_tokens": 2})
        _assert_error(status, body, 400, "prompt")
        assert "characters" in body["error"]["message"] and time.perf_counter() - t0 < 5
    finally:
        srv.stop()


class _SlowTokenizer:
    """The model's tokenizer, except that encoding a text containing `mark` takes `delay` seconds (as a
    20 MB prompt does)."""

    def __init__(self, tok, mark: str, delay: float):
        self.tok, self.mark, self.delay = tok, mark, delay

    def encode(self, text, *args, **kw):
        if self.mark in text:
            time.sleep(self.delay)
        return self.tok.encode(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_tokenising_runs_off_the_event_loop(server, model):
    """While one prompt takes seconds to tokenise, the event loop keeps serving: /health and a token-id
    completion are answered before it is done; the slow request then completes."""
    mark, delay = "slow-" + os.urandom(4).hex(), 4.0
    ctx = ServingContext((NAME,), _SlowTokenizer(model.tokenizer, mark, delay), MAX_LEN,
                         model.config.model.vocab_size)
    srv = ServerThread(app=build_app(server.aengine, ctx, AccessPolicy(bind_host="127.0.0.1"))).start()
    try:
        out = {}
        slow = threading.Thread(target=lambda: out.update(
            r=_post(srv.url, "/v1/completions", {"prompt": f"a {mark} b", "max_tokens": 2, "ignore_eos": True})), daemon=True)
        t0 = time.perf_counter()
        slow.start()
        time.sleep(0.3)
        assert _health(srv.url) == 200
        status, body = _post(srv.url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert time.perf_counter() - t0 < delay - 1 and slow.is_alive()
        slow.join(60)
        assert out["r"][0] == 200 and out["r"][1]["usage"]["completion_tokens"] == 2
    finally:
        srv.stop()


# ----- access policy ------------------------------------------------------------------------------

def test_api_key_host_and_cors(server):
    """--api-key: /v1/* needs the bearer token (401 JSON otherwise), /health does not; a foreign Host on a
    loopback bind: 403 (DNS rebinding), even as a text/plain POST; CORS closed unless the origin is allowed."""
    key = "sk-" + os.urandom(8).hex()
    origin = f"http://localhost:{np.random.default_rng().integers(1024, 65000)}"
    policy = AccessPolicy(api_key=key, allowed_origins=(origin,), bind_host="127.0.0.1")
    srv = ServerThread(app=build_app(server.aengine, ServingContext((NAME,), server.aengine.engine.tokenizer,
                                                                    MAX_LEN, 10**6), policy))
    srv.start()
    try:
        url, body = srv.url, {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
        for hdrs in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            status, resp = _post(url, "/v1/completions", body, headers=hdrs)
            _assert_error(status, resp, 401)
            assert resp["error"]["code"] == "invalid_api_key"
        assert _request(url, "/v1/models")[0] == 401
        auth = {"Authorization": f"Bearer {key}"}
        status, resp = _post(url, "/v1/completions", body, headers=auth)
        assert status == 200 and resp["usage"]["completion_tokens"] == 2
        assert _health(url) == 200  # no key needed outside /v1

        # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends its own Host
        status, _, raw = _request(url, "/v1/completions", json.dumps(body).encode(),
                                  headers={**auth, "Host": "evil.example:8000", "Content-Type": "text/plain"})
        _assert_error(status, json.loads(raw), 403)
        status, _, raw = _request(url, "/v1/models", headers={**auth, "Host": "rebind.attacker.test"})
        assert status == 403
        assert _request(url, "/v1/models", headers={**auth, "Host": f"localhost:{srv.port}"})[0] == 200

        # CORS: a foreign origin gets 403 and no CORS headers; the allowed one gets them, preflight included
        status, hdrs, _ = _request(url, "/v1/models", headers={**auth, "Origin": "http://evil.example"})
        assert status == 403 and "Access-Control-Allow-Origin" not in hdrs
        status, hdrs, _ = _request(url, "/v1/completions", method="OPTIONS",
                                   headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert status == 403 and "Access-Control-Allow-Origin" not in hdrs
        status, hdrs, _ = _request(url, "/v1/completions", method="OPTIONS",
                                   headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204 and hdrs["Access-Control-Allow-Origin"] == origin
        assert "POST" in hdrs["Access-Control-Allow-Methods"]
        status, hdrs, _ = _request(url, "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                   headers={**auth, "Origin": origin})
        assert status == 200 and hdrs["Access-Control-Allow-Origin"] == origin
    finally:
        srv.stop()
    # the default (no --allowed-origins): any Origin is refused, nothing CORS is ever sent
    status, hdrs, _ = _request(server.url, "/v1/models", headers={"Origin": origin})
    assert status == 403 and "Access-Control-Allow-Origin" not in hdrs


# ----- engine faults ------------------------------------------------------------------------

def test_step_fault_fails_only_its_requests(server, model):
    """A decode step that raises fails the requests of that step (500 JSON; a stream: error event, then
    [DONE]); the engine goes on: /health 200, later requests are served, request_errors counts them."""
    runner = model.engine.runner
    poison = int(np.random.default_rng().integers(2, 200))
    real = runner.dispatch_decode  # every decode step, synchronous (decode) or overlapped

    def faulty(seqs, *args):
        if any(s.token_ids[0] == poison and s.num_output_tokens >= 2 for s in seqs):
            raise OverflowError("injected fault")
        return real(seqs, *args)

    before = parse_metrics(_request(server.url, "/metrics")[2].decode())
    runner.dispatch_decode = faulty
    try:
        prompt = [poison, 7, 8, 9]
        status, body = _post(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 20, "ignore_eos": True})
        _assert_error(status, body, 500)
        assert "injected fault" in body["error"]["message"]
        status, _, raw = _request(server.url, "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "stream": True}).encode())
        events = _sse_events(raw)
        assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == 500
        assert _health(server.url) == 200
        status, body = _post(server.url, "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 6,
                                                             "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 6
    finally:
        runner.dispatch_decode = real
    after = parse_metrics(_request(server.url, "/metrics")[2].decode())
    assert after["moejax:request_errors_total"] - before["moejax:request_errors_total"] == 2
    assert "vllm:prefix_cache_queries_total" in after and "vllm:prefix_cache_hits_total" in after
    eng = model.engine
    deadline = time.time() + 10
    while eng.blocks.num_free != eng.blocks.num_blocks and time.time() < deadline:
        time.sleep(0.05)
    assert eng.blocks.num_free == eng.blocks.num_blocks  # the failed requests' blocks were freed


def test_preempted_too_often_ends_with_an_error(tiny_path):
    """A cache too small for the load with max_preemptions=0: a request preempted is given up with a 503 (a
    stream: an error event naming the preemption, then [DONE]; non-streaming: the JSON error), the others
    finish with all their tokens; the server stays healthy, request_errors counts the failures and every
    KV block is free again."""
    m = moejax.load(tiny_path, dtype="float32", block_size=8, num_kv_blocks=16, max_model_len=128, max_num_seqs=8,
                    max_preemptions=0, progress=False)
    srv = ServerThread(m, model_name=NAME).start()
    try:
        rng = np.random.default_rng()
        # each needs up to 15 of the 16 blocks alone: any two running at once collide
        bodies = [{"prompt": rng.integers(2, 300, size=int(rng.integers(20, 30))).tolist(), "max_tokens": 90,
                   "ignore_eos": True, "return_token_ids": True} for _ in range(6)]
        outs = [{} for _ in bodies]

        def plain(body, out):
            out["status"], out["body"] = _post(srv.url, "/v1/completions", body)

        threads = [_stream_in_thread(srv.url, b, o) if i % 2 else threading.Thread(target=plain, args=(b, o))
                   for i, (b, o) in enumerate(zip(bodies, outs))]
        for t in threads[::2]:
            t.start()
        for t in threads:
            t.join(120)
        failed = 0
        for i, o in enumerate(outs):
            if i % 2:  # streamed
                ev = o["events"]
                assert o["status"] == 200 and ev[-1] == "[DONE]", ev[-3:]
                if "error" in ev[-2]:
                    failed += 1
                    assert ev[-2]["error"]["code"] == 503 and "preemption" in ev[-2]["error"]["message"]
                else:
                    assert ev[-2]["choices"][0]["finish_reason"] == "length"
                    assert sum(len(e["choices"][0]["token_ids"]) for e in ev[:-1] if e.get("choices")) == 90
            elif o["status"] == 200:
                assert o["body"]["usage"]["completion_tokens"] == 90
            else:
                failed += 1
                _assert_error(o["status"], o["body"], 503)
                assert "preemption" in o["body"]["error"]["message"]
        assert failed > 0
        metrics = parse_metrics(_request(srv.url, "/metrics")[2].decode())
        assert metrics["moejax:request_errors_total"] == failed == metrics["vllm:num_preemptions_total"]
        assert _health(srv.url) == 200
        status, body = _post(srv.url, "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 5})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert m.engine.blocks.num_free == m.engine.blocks.num_blocks
    finally:
        srv.stop()


class _FakeEngine:
    """Emits one token per step for every accepted sequence (after `delay` s), finishing each at its
    max_new_tokens; from step `die_at` on, every step raises with no sequence to blame (engine dead)."""

    class _Sched:
        def __init__(self):
            self.waiting, self.prefilling, self.running, self.num_preemptions = deque(), [], [], 0

    class _Blocks:
        usage, num_free, num_blocks = 0.0, 1, 1

    def __init__(self, delay=0.02, die_at=None):
        self.scheduler, self.blocks, self.stats = self._Sched(), self._Blocks(), EngineStats()
        self.delay, self.die_at, self.steps, self.seqs = delay, die_at, 0, []
        self.tokenizer = None

    def add_request(self, ids, params):
        seq = Sequence(ids, params, 0)
        self.seqs.append(seq)
        return seq

    def has_unfinished(self):
        return any(not s.is_finished for s in self.seqs)

    def step(self):
        self.steps += 1
        time.sleep(self.delay)
        if self.die_at is not None and self.steps >= self.die_at:
            raise RuntimeError("injected engine death")
        live = [s for s in self.seqs if not s.is_finished]
        for s in live:
            s.token_ids.append(5 + s.num_output_tokens % 50)
            if s.num_output_tokens >= s.params.max_new_tokens:
                s.status, s.finish_reason, s.text = Status.FINISHED, "length", "x"
        return "decode", live

    def abort(self, seq):
        seq.status, seq.finish_reason = Status.FINISHED, "abort"

    def pop_failed(self):
        return []


def _fake_server(model, engine, shutdown_timeout=5.0, exit_on_engine_death=True):
    aengine = AsyncEngine(engine, "fake").start()
    ctx = ServingContext(("fake",), model.tokenizer, 100_000, model.config.model.vocab_size)
    return ServerThread(app=build_app(aengine, ctx, AccessPolicy(bind_host="127.0.0.1")),
                        shutdown_timeout=shutdown_timeout, exit_on_engine_death=exit_on_engine_death).start()


def _stream_in_thread(url, body, out: dict):
    def run():
        status, _, raw = _request(url, "/v1/completions", json.dumps({**body, "stream": True}).encode())
        out["status"], out["events"], out["t"] = status, _sse_events(raw), time.perf_counter()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_engine_death_errors_streams_and_exits_nonzero(model):
    """The engine dies with streams in flight: each ends with an error event then [DONE], /health says
    503, and the server's run returns 1 within seconds (scripts/serve.py exits with it)."""
    srv = _fake_server(model, _FakeEngine(delay=0.02, die_at=int(np.random.default_rng().integers(5, 15))))
    outs = [{} for _ in range(3)]
    threads = [_stream_in_thread(srv.url, {"prompt": [5, 6], "max_tokens": 1000}, o) for o in outs]
    for t in threads:
        t.join(30)
    for o in outs:
        ev = o["events"]
        assert o["status"] == 200 and ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == 503, ev[-3:]
        assert "injected engine death" in ev[-2]["error"]["message"]
        assert any("choices" in e for e in ev[:-2])  # tokens came before the death
    t0 = time.perf_counter()
    srv._thread.join(15)
    assert not srv._thread.is_alive() and srv.exit_code == 1 and time.perf_counter() - t0 < 10


def test_graceful_shutdown_drains_then_aborts(model):
    """Stop: no new connections; a request that finishes within the grace period completes normally; one
    still running after it (it would run for 1000 s) gets an error event and [DONE]; the run returns 0
    within EXIT_AFTER_DRAIN_S of the grace period's end: with the default grace, well inside Kubernetes'
    30 s between SIGTERM and SIGKILL."""
    assert DEFAULT_SHUTDOWN_TIMEOUT_S + EXIT_AFTER_DRAIN_S <= 25
    grace = 1.5
    srv = _fake_server(model, _FakeEngine(delay=0.02), shutdown_timeout=grace)
    short, long_ = {}, {}
    ts = [_stream_in_thread(srv.url, {"prompt": [5, 6], "max_tokens": 30}, short),
          _stream_in_thread(srv.url, {"prompt": [7, 8], "max_tokens": 50_000}, long_)]
    time.sleep(0.3)
    t0 = time.perf_counter()
    stopped = {}

    def stop():
        srv.stop()
        stopped["t"] = time.perf_counter()
    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    time.sleep(0.2)
    with pytest.raises(OSError):  # the listening socket is closed
        socket.create_connection((srv.host, srv.port), timeout=2).close()
    for t in ts:
        t.join(20)
    stopper.join(20)
    assert short["events"][-1] == "[DONE]" and short["events"][-2]["choices"][0]["finish_reason"] == "length"
    ev = long_["events"]
    assert ev[-1] == "[DONE]" and "shutting down" in ev[-2]["error"]["message"], ev[-3:]
    assert grace - 0.3 <= long_["t"] - t0 < grace + 3
    # the whole exit, from the stop request: drain, abort, flush, close (+ 0.5 s: the fake engine's last step
    # and a loaded machine)
    assert srv.exit_code == 0 and stopped["t"] - t0 <= grace + EXIT_AFTER_DRAIN_S + 0.5, stopped["t"] - t0


def test_sigterm_exits_zero_with_streams_ended(tiny_path):
    """scripts/serve.py under SIGTERM or SIGINT (drawn per run) with a stream in flight: the stream ends with
    [DONE] (finished, or aborted with an error event after --shutdown-timeout) and the process exits 0
    within seconds of the drain's end."""
    sig = [signal.SIGTERM, signal.SIGINT][int(np.random.default_rng().integers(2))]
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve.py"), "--model", tiny_path,
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
                             "--num-kv-blocks", "256", "--max-num-seqs", "4", "--shutdown-timeout", "1",
                             "--no-precompile"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if _health(url) == 200:
                    break
            except OSError:
                time.sleep(0.3)
        assert _health(url) == 200
        out = {}
        t = _stream_in_thread(url, {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}, out)
        time.sleep(1.0)
        t0 = time.perf_counter()
        proc.send_signal(sig)
        t.join(30)
        code = proc.wait(30)
        # the drain (--shutdown-timeout 1), then EXIT_AFTER_DRAIN_S at most, then the interpreter's exit
        # (about 2 s here on an idle machine)
        assert code == 0 and time.perf_counter() - t0 < 1 + EXIT_AFTER_DRAIN_S + 6
        ev = out["events"]
        assert ev[-1] == "[DONE]" and ("error" in ev[-2] or ev[-2]["choices"][0]["finish_reason"] == "length")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- start-up checks ------------------------------------------------------------------------

def test_max_model_len_beyond_cache_refused(tiny_path):
    """A cache smaller than one max_model_len sequence is refused at engine construction, naming both
    numbers and the flags (it used to start, then stall forever on a long request)."""
    rng = np.random.default_rng()
    blocks = int(rng.integers(2, 30))
    m = moejax.load(tiny_path, dtype="float32", max_model_len=blocks * 16 + int(rng.integers(1, 200)),
                    num_kv_blocks=blocks, progress=False)
    with pytest.raises(ValueError) as ei:
        make_app(m, NAME)
    msg = str(ei.value)
    assert str(m.max_model_len) in msg and str(blocks * 16) in msg and "--num-kv-blocks" in msg
    ok = moejax.load(tiny_path, dtype="float32", max_model_len=blocks * 16, num_kv_blocks=blocks, progress=False)
    assert ok.engine.max_model_len == blocks * 16


def test_corrupt_checkpoint_files_named(tiny_path, tmp_path):
    """Corrupt or missing config.json / tokenizer_config.json / safetensors: a ValueError naming the file."""
    rng = np.random.default_rng()

    def copy(name):
        d = str(tmp_path / name)
        shutil.copytree(tiny_path, d)
        return d

    d = copy("bad_config")
    with open(os.path.join(d, "config.json"), "r+") as f:
        text = f.read()
        f.seek(0)
        f.truncate()
        f.write(text[:int(rng.integers(1, len(text) - 1))])
    with pytest.raises(ValueError, match="config.json"):
        moejax.load(d, progress=False)

    d = copy("bad_tok_config")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        moejax.load(d, progress=False)

    d = copy("bad_weights")
    st = [f for f in os.listdir(d) if f.endswith(".safetensors")][0]
    p = os.path.join(d, st)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:  # the header's JSON, garbled
        f.seek(8 + int(rng.integers(0, 20)))
        f.write(b"\xff\x00{{")
    with pytest.raises(ValueError, match=st):
        moejax.load(d, progress=False)
    d = copy("truncated_weights")
    with open(os.path.join(d, st), "r+b") as f:
        f.truncate(int(rng.integers(size // 2, size - 1)))
    with pytest.raises(ValueError, match=st):
        moejax.load(d, progress=False)
