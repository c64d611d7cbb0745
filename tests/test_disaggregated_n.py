"""n > 1 through the disaggregated server (issue 43): scripts/serve.py --disaggregated over a prefill and a
decode worker process started here (known by URL, so the prefill worker's /metrics can be read), against the
colocated server of the same checkpoint. The prompt is prefilled once: the other samples go, once the first
one's prefill answered, to the prefill worker that holds its blocks (router.py ``after``) and compute only
what its prefix cache lacks, as in one process (LLMEngine.add_request's ``after``)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import moejax
from moejax.engine.sampling_params import SamplingParams
from moejax.server.app import ServerThread, free_port
from moejax.server.async_engine import RequestStream
from moejax.server.metrics import parse_metrics
from moejax.server.router import Router, WorkerHandle
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from conftest import wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny-disagg-n"
MAX_LEN = 128
BLOCK = 16  # every server's KV block size (the default, passed explicitly: the expected count depends on it)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=7, std=0.1)


@pytest.fixture(scope="module")
def servers(tiny_path):
    """(colocated URL, router URL, prefill worker URL): the colocated server in this process; the prefill and
    decode workers and the router as processes."""
    model = moejax.load(tiny_path, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8, block_size=BLOCK,
                        progress=False)
    colocated = ServerThread(model, model_name=NAME).start()
    serve = os.path.join(ROOT, "scripts", "serve.py")
    common = ["--model", tiny_path, "--served-model-name", NAME, "--dtype", "float32", "--max-model-len",
              str(MAX_LEN), "--max-num-seqs", "8", "--block-size", str(BLOCK), "--shutdown-timeout", "5",
              "--no-precompile"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    urls, procs = {}, []
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, serve, *common, "--role", role, "--port", str(port)],
                                          env=env))
            urls[role] = f"http://127.0.0.1:{port}"
        for role, p in zip(("prefill", "decode"), procs):
            wait_healthy(p, urls[role], f"the {role} worker")
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, serve, *common, "--disaggregated", "--prefill-urls",
                                       urls["prefill"], "--decode-urls", urls["decode"], "--port", str(port)],
                                      env=env))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(procs[-1], url, "the router")
        yield colocated.url, url, urls["prefill"]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
        colocated.stop()


def _prefill_counts(url) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = parse_metrics(r.read().decode())
    return m["moejax:prefill_tokens_total"], m["moejax:prefill_steps_total"]


def _complete(url, body) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": NAME, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_n_samples_prefill_the_prompt_once(servers):
    """Reference: the colocated server (one process, LLMEngine's ``after``). An n = 3 request of a 48-token
    prompt through the router: the prefill worker computes the prompt once plus each other sample's last
    partial block (48 + 2 x 16 tokens), the colocated engine's own count; the 3 samples' token ids equal the
    colocated server's for the same seed (sample j with seed + j), each handed off and decoded, plain and
    streamed."""
    colocated, router, prefill = servers
    rng = np.random.default_rng()
    L = 48
    body = {"prompt": rng.integers(2, 300, size=L).tolist(), "n": 3, "max_tokens": 6, "temperature": 1.0,
            "seed": int(rng.integers(1 << 30)), "ignore_eos": True, "return_token_ids": True}
    before = _prefill_counts(colocated)[0]
    want = _complete(colocated, body)
    one_process = _prefill_counts(colocated)[0] - before
    before = _prefill_counts(prefill)[0]
    got = _complete(router, body)
    prefilled = _prefill_counts(prefill)[0] - before
    assert one_process == L + 2 * (L - (L - 1) // BLOCK * BLOCK) == 80
    assert prefilled == one_process, (prefilled, one_process)
    ids = [c["token_ids"] for c in got["choices"]]
    assert ids == [c["token_ids"] for c in want["choices"]]
    assert len(ids) == 3 and all(len(t) == 6 for t in ids) and len({tuple(t) for t in ids}) > 1
    assert got["usage"] == want["usage"]
    assert _streamed(router, body) == _streamed(colocated, body) == ids  # the samples' streams interleaved


def _streamed(url, body) -> list[list[int]]:
    """Each choice's token ids from a streamed request, by choice index."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": NAME, **body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = [[] for _ in range(body["n"])]
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                for c in json.loads(line[6:])["choices"]:
                    out[c["index"]] += c["token_ids"]
    return out


def test_samples_go_to_the_first_samples_prefill_worker():
    """Routing rule (router.py _prefill_worker): a sample with ``after`` waits until its first sample's
    prefill answered, then goes to that prefill worker (its prefix cache holds the prompt) even when another
    one is less loaded; to the least loaded once that worker is dead, or when the first sample was never
    prefilled."""
    pre = [WorkerHandle("prefill", i, f"http://p{i}", inflight=n) for i, n in enumerate([0, 5, 2])]
    router = Router(pre, [WorkerHandle("decode", 0, "http://d0")])

    async def main():
        loop = asyncio.get_running_loop()
        first, sample = (RequestStream(router, [3, 4, 5], SamplingParams(), loop) for _ in range(2))
        first.prompt_worker, sample.after = loop.create_future(), first
        pick = asyncio.ensure_future(router._prefill_worker(sample))
        await asyncio.sleep(0.05)
        assert not pick.done()  # before the first sample's prefill answered: its prompt is cached nowhere yet
        first.prompt_worker.set_result(pre[1])
        assert await pick is pre[1]
        pre[1].dead = "gone"
        assert await router._prefill_worker(sample) is pre[0]
        first.prompt_worker = loop.create_future()
        first.prompt_worker.set_result(None)
        assert await router._prefill_worker(sample) is pre[0]

    asyncio.run(main())
