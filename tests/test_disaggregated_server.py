"""scripts/serve.py --disaggregated (1 prefill worker process it starts, 1 decode worker process given by
URL, the router in front) against the colocated server of the same checkpoint: the same token ids, texts,
finish reasons and logprobs for greedy and seeded sampling, plain and streamed (chunks, usage); the decode
worker's first pull is made to fail (--inject-kv-transfer-failures 1) and that request is re-queued and
still completes with the colocated tokens; /metrics counts the transfers, their bytes and the failure; a killed worker is reported (/health
503, an OpenAI-style JSON error naming it) and the router exits non-zero instead of hanging."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from moejax.server.app import free_port
from moejax.server.metrics import parse_metrics
from moejax.server.router import Router, WorkerGone, WorkerHandle, kv_usage
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

import openai  # noqa: E402  (in the test extra)
from conftest import http_get, openai_client, serving, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny-disagg"
MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=7, std=0.1)


@pytest.fixture(scope="module")
def colocated(tiny_path):
    with serving(tiny_path, NAME, max_model_len=MAX_LEN, max_num_seqs=8) as srv:
        yield openai_client(srv.url)


@pytest.fixture(scope="module")
def router(tiny_path):
    """The disaggregated server as processes: (the router's Popen, its URL, the decode worker's Popen). The
    router starts its prefill worker; the decode worker (block size 8, its first pull made to fail) is
    started here and given to the router by URL (--decode-urls): both ways of having workers."""
    serve = os.path.join(ROOT, "scripts", "serve.py")
    common = ["--model", tiny_path, "--served-model-name", NAME, "--dtype", "float32", "--max-model-len",
              str(MAX_LEN), "--max-num-seqs", "8", "--shutdown-timeout", "5", "--no-precompile"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    dport, port = free_port(), free_port()
    decode = subprocess.Popen([sys.executable, serve, *common, "--role", "decode", "--block-size", "8",
                               "--port", str(dport), "--inject-kv-transfer-failures", "1"], env=env)
    durl, url = f"http://127.0.0.1:{dport}", f"http://127.0.0.1:{port}"
    wait_healthy(decode, durl, "the decode worker")
    proc = subprocess.Popen([sys.executable, serve, *common, "--disaggregated", "--decode-urls", durl,
                             "--port", str(port)], env=env)
    wait_healthy(proc, url, "the router")
    yield proc, url, decode
    for p in (proc, decode):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(60)


@pytest.fixture(scope="module")
def disagg(router):
    return openai_client(router[1])


def _requests(rng, n=4):
    """Greedy and seeded (temperature 0.9, top-p, top-k) requests alternating, token-id prompts."""
    out = []
    for i in range(n):
        sample = dict(temperature=0.9, top_p=0.85, seed=int(rng.integers(1 << 30))) if i % 2 else dict(temperature=0)
        out.append(dict(prompt=rng.integers(2, 300, size=int(rng.integers(3, 40))).tolist(),
                        max_tokens=int(rng.integers(2, 14)), logprobs=2, **sample,
                        extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 40}))
    return out


def _full(client, kw):
    ch = client.completions.create(model=NAME, **kw).choices[0]
    return ch.text, ch.model_extra["token_ids"], ch.finish_reason, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs


def _streamed(client, kw):
    chunks = list(client.completions.create(model=NAME, stream=True, stream_options={"include_usage": True}, **kw))
    toks = [c for c in chunks if c.choices]
    return ("".join(c.choices[0].text for c in toks), [t for c in toks for t in c.choices[0].model_extra["token_ids"]],
            toks[-1].choices[0].finish_reason, chunks[-1].usage.model_dump())


def test_same_tokens_as_colocated_with_a_failed_transfer(colocated, disagg, router):
    """Reference: the colocated server. Plain requests (the first one's KV pull fails and it is prefilled
    again): the same texts, token ids, finish reasons, top-logprob tokens, logprobs (1e-5); /metrics
    shows one transfer per decoded request, their bytes and the one failure."""
    reqs = _requests(np.random.default_rng())
    for kw in reqs:
        want, got = _full(colocated, kw), _full(disagg, kw)
        assert got[:3] == want[:3]
        np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-5)
        assert [sorted(t) for t in got[4]] == [sorted(t) for t in want[4]]
    m = parse_metrics(http_get(router[1] + "/metrics")[1].decode())
    assert m["moejax:kv_transfer_failures_total"] == 1
    assert m["moejax:kv_transfer_seconds_count"] == len(reqs) and m["moejax:kv_transfer_bytes_total"] > 0
    assert m["vllm:request_success_total"] == len(reqs)


def test_streaming_same_as_colocated(colocated, disagg):
    """Reference: the colocated server's stream. Streamed greedy and seeded requests: the same
    concatenated text, token ids, finish reason and usage chunk."""
    for kw in _requests(np.random.default_rng(), 3):
        kw.pop("logprobs")
        assert _streamed(disagg, kw) == _streamed(colocated, kw)


def test_bad_request_is_an_openai_error(disagg):
    """Invariant: a prompt longer than max_model_len is a 400 OpenAI-style error naming the prompt."""
    with pytest.raises(openai.BadRequestError) as e:
        disagg.completions.create(model=NAME, prompt=[5] * (MAX_LEN + 4), max_tokens=4)
    assert e.value.body["param"] == "prompt"


def test_dead_worker_reported(router, disagg):
    """Invariant: a decode worker killed mid-stream is reported: the stream in flight ends with an
    OpenAI-style error event and [DONE] (no hang), /health answers 503 with a JSON error naming the
    worker (known by its URL: failed health checks), and the router process exits non-zero."""
    proc, url, decode = router
    body = json.dumps({"model": NAME, "prompt": [5, 6, 7], "max_tokens": MAX_LEN - 8, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: {")  # streaming: the worker holds the request now
        decode.kill()
        events = [line[6:].strip() for line in r.read().split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    deadline = time.monotonic() + 20
    while True:
        status, body = http_get(url + "/health")
        if status == 503:
            break
        assert time.monotonic() < deadline, "the dead worker was not reported"
        time.sleep(0.2)
    assert "decode worker" in json.loads(body)["error"]["message"]
    assert proc.wait(30) != 0


def test_decode_worker_with_the_most_room_is_chosen():
    """Routing rule (router.py _pick): a decode request goes to the live decode worker whose KV cache is
    least claimed (claimed tokens / capacity, capacities differing), ties to the fewest requests; a
    prefill request to the fewest in flight; no live worker of a role is an error naming the role."""
    rng = np.random.default_rng()
    cap = [int(c) for c in rng.integers(1_000, 100_000, size=3)]
    claim = [int(rng.integers(0, c)) for c in cap]
    dec = [WorkerHandle("decode", i, f"http://d{i}", kv_tokens=c, reserved_tokens=r, inflight=int(rng.integers(9)))
           for i, (c, r) in enumerate(zip(cap, claim))]
    pre = [WorkerHandle("prefill", i, f"http://p{i}", inflight=n) for i, n in enumerate(rng.permutation(3).tolist())]
    router = Router(pre, dec)
    assert router._pick(dec) is dec[int(np.argmin(np.array(claim) / np.array(cap)))]
    assert router._pick(pre) is pre[[w.inflight for w in pre].index(0)]
    for w in dec:
        w.reserved_tokens = 0
    assert router._pick(dec) is min(dec, key=lambda w: (w.inflight, w.index))
    for w in dec:
        w.dead = "gone"
    with pytest.raises(WorkerGone, match="no live decode worker"):
        router._pick(dec)


def test_router_kv_usage_sums_the_decode_workers():
    """vllm:kv_cache_usage_perc on the router (router.py kv_usage over the decode workers' /internal/load):
    blocks in use over all blocks of every decode worker, caches of different sizes weighted by their
    blocks (not a mean of the workers' shares); None when no worker answered."""
    rng = np.random.default_rng()
    loads = [{"num_blocks": int(n), "free_blocks": int(rng.integers(0, n + 1)), "inflight": 0}
             for n in rng.integers(1, 10_000, size=3)]
    used = sum(x["num_blocks"] - x["free_blocks"] for x in loads)
    assert kv_usage(loads) == pytest.approx(used / sum(x["num_blocks"] for x in loads), rel=1e-12)
    assert kv_usage([]) is None
