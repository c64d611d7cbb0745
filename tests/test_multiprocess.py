"""One mesh over several processes (jax.distributed, gloo CPU collectives): 2 processes x 4 CPU devices,
started by ``python -m moejax.launch``, against this process's 8 devices.

- generate (a2a backend with EPLB rebalancing, and the replicated backend), score logits and an orbax
  save/load round trip give what 1 process x 8 devices gives: tests/multiprocess_generate.py;
- scripts/serve.py: a request through process 0's front end gives the same tokens; SIGTERM stops every
  process (exit 0); a killed worker makes /health fail and the server exit non-zero in bounded time;
- the server's replay (process 0's engine calls on another engine) in this one process, and the
  launcher's, the environment's and the layout's errors.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

import moejax
from moejax.engine.llm_engine import LLMEngine
from moejax.engine.replicated import LeaderEngine, follow, state_digest
from moejax.engine.sampling_params import SamplingParams
from moejax.launch import build_parser, check_args, child_env
from moejax.parallel import processes
from moejax.parallel.sharding import make_mesh
from moejax.server.app import ServerThread, free_port, make_app
from moejax.server.metrics import parse_metrics
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import multiprocess_generate

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")

# 32 experts, top-4 over 8 ranks (as tests/test_expert_parallel.py); 8 redundant slots for EPLB.
CFG = preset("v3-tiny", n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)
LAYOUTS = {
    "a2a": "moe_backend: a2a\nnum_redundant_experts: 8\neplb_interval: 4\neplb_window: 100\n",
    "replicated": "moe_backend: replicated\n",
}
PEER_TIMEOUT_S = 3.0
DETECT_BOUND_S = PEER_TIMEOUT_S + 12  # the watch's period, the drain (lifecycle FLUSH_S) and a loaded machine


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    ckpt = str(d / "ckpt")
    make_random_checkpoint(ckpt, CFG, seed=21, std=0.1)
    layouts = {}
    for name, extra in LAYOUTS.items():
        layouts[name] = str(d / f"{name}.yaml")
        Path(layouts[name]).write_text(f"data_parallel_size: 8\nexpert_parallel_size: 8\n{extra}")
    rng = np.random.default_rng()
    spec = {"layouts": layouts, "max_new_tokens": 6,
            # one prompt per rank: the server's one request runs the same (batch 1) programs, compiled once
            "prompts": [rng.integers(2, 300, size=int(rng.integers(3, 20))).tolist() for _ in range(8)],
            "score_ids": rng.integers(2, 300, size=(8, 12)).tolist()}
    return d, ckpt, spec


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _launch(log: Path, *args):
    """The launcher with 2 processes x 4 CPU devices; their output goes to ``log`` (a file: a pipe nobody
    reads while the test waits could fill and block them)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moejax.launch", "--nproc", "2", "--devices-per-process", "4",
                                 *args], cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: _kill ends the whole job
    proc.log = log
    return proc


def _kill(proc) -> None:
    """The launcher and its children, whatever state they are in."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _output(proc) -> str:
    text = proc.log.read_text(errors="replace")
    return "\n".join(line for line in text.splitlines() if "[Gloo]" not in line)[-6000:]


_REFERENCE = {}


def _reference(job) -> dict:
    """1 process x 8 devices (this one): what tests/multiprocess_generate.py computes, once per module."""
    if not _REFERENCE:
        _REFERENCE.update(multiprocess_generate.run(job[1], job[2]))
    return _REFERENCE


def _assert_same_generation(got, want, tol):
    assert got["tokens"] == want["tokens"]
    for x, y in zip(got["logprobs"], want["logprobs"]):
        np.testing.assert_allclose(x, y, rtol=0, atol=tol)
    for x, y in zip(got["top"], want["top"]):  # [(token id, logprob)] per position
        for a, b in zip(x, y):
            np.testing.assert_allclose([lp for _, lp in a], [lp for _, lp in b], rtol=0, atol=tol)


def test_two_processes_generate_like_one(job):
    """2 x 4 devices: the same greedy tokens (6 steps, 8 prompts), logprobs and top-2 (a2a: equal;
    replicated: 1e-5, gloo's psum adds in another order), score logits, EPLB's rebalances, window and
    placements (a2a), as 1 x 8 devices; orbax saves from 2 processes load back bitwise equal."""
    d, ckpt, spec = job
    # a2a's redundant slots: restored to host memory, then placed; replicated: restored shard by shard
    two = dict(spec, save_dir=str(d / "saved2"), save_layouts=["a2a", "replicated"])
    (d / "spec2.json").write_text(json.dumps(two))
    proc = _launch(d / "generate.log", "--", "tests/multiprocess_generate.py", ckpt, str(d / "spec2.json"), str(d / "out2.json"))
    want = _reference(job)  # meanwhile, here
    try:
        proc.wait(timeout=240)
    finally:
        _kill(proc)
    assert proc.returncode == 0, _output(proc)
    out = json.loads((d / "out2.json").read_text())
    assert out["processes"] == 2
    for name, tol in (("a2a", 0.0), ("replicated", 1e-5)):
        got, ref = out["results"][name], want[name]
        _assert_same_generation(got, ref, tol)
        np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=max(tol, 1e-12))
        assert got["rebalances"] == ref["rebalances"] and got["placements"] == ref["placements"]
        np.testing.assert_array_equal(got["window_load"], ref["window_load"])
    assert want["a2a"]["rebalances"] >= 1  # the layout moved experts during the run
    assert out["results"]["a2a"]["reloaded_equal"] is True  # after EPLB moved experts; restored to host
    assert out["results"]["replicated"]["reloaded_equal"] is True  # restored shard by shard


def _get(url, body=None, timeout=60):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


def _health(base) -> int | None:
    try:
        return _get(base + "/health", timeout=2)[0]
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None  # not listening (not yet, or no longer)


def _serve(job, layout, port):
    d, ckpt, spec = job
    return _launch(d / f"serve-{layout}.log", "--grace", "20", "--", "scripts/serve.py", "--model", ckpt, "--parallel", spec["layouts"][layout],
                   "--dtype", "float32", "--max-model-len", "96", "--max-num-seqs", "4", "--num-kv-blocks", "24",
                   "--no-precompile", "--port", str(port), "--peer-timeout", str(PEER_TIMEOUT_S))


def _wait_healthy(proc, base, timeout=180):
    deadline = time.monotonic() + timeout
    while _health(base) != 200:
        assert proc.poll() is None, _output(proc)
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def _prefix_hits(base) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())["vllm:prefix_cache_hits_total"]


def _child_with_process_id(launcher_pid: int, process_id: int) -> int:
    """The launcher's child that is process ``process_id`` of the job (Linux /proc)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"{processes.PROCESS_ID_ENV}={process_id}".encode() in env:
            return int(pid)
    raise AssertionError(f"no child of the launcher is process {process_id}: {children}")


def _complete(base, job, i):
    prompt = job[2]["prompts"][i]
    status, body = _get(base + "/v1/completions", {"model": job[1], "prompt": prompt, "max_tokens": 6,
                                                   "logprobs": 2, "ignore_eos": True,
                                                   "temperature": 0})
    assert status == 200
    return body["choices"][0]["logprobs"]["token_logprobs"], body


@pytest.mark.parametrize("layout", ["a2a", "replicated"])
def test_two_process_server(job, layout):
    """scripts/serve.py over 2 x 4 devices: a request through process 0's front end samples what 1 x 8
    devices' generate samples (logprobs 1e-5: the request runs alone here, batched there); then a2a: a killed worker
    makes /health fail within the peer timeout and the job exit non-zero; replicated: SIGTERM to the
    launcher stops every process cleanly (exit 0)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _serve(job, layout, port)
    try:
        ref = _reference(job)[layout]  # computed while the server starts, unless the generate test did
        _wait_healthy(proc, base)
        lps, body = _complete(base, job, 0)
        np.testing.assert_allclose(lps, ref["logprobs"][0], rtol=0, atol=1e-5)
        assert body["usage"]["completion_tokens"] == 6
        if layout == "replicated":
            # n = 3 through process 0: the other processes replay the held samples; the prompt is prefilled once
            # (each other sample hits the 32 tokens of full blocks before its last token, block size 8 or 16)
            hits0 = _prefix_hits(base)
            status, body = _get(base + "/v1/completions", {"model": job[1], "prompt": list(range(2, 42)), "n": 3,
                                                           "max_tokens": 4, "temperature": 1.0, "seed": 3,
                                                           "ignore_eos": True})
            assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
            assert _prefix_hits(base) - hits0 == 2 * 32
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, _output(proc)
            return
        victim = _child_with_process_id(proc.pid, 1)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        while (health := _health(base)) == 200:
            assert time.monotonic() - t0 < DETECT_BOUND_S, "the server still reports healthy"
            time.sleep(0.1)
        assert health == 503  # before the listener closes (lifecycle.DEAD_REPORT_S)
        code = proc.wait(timeout=DETECT_BOUND_S + 20)
        assert code != 0, _output(proc)
        assert time.monotonic() - t0 < DETECT_BOUND_S + 20
        assert "process 1 of 2 stopped responding" in _output(proc)
    finally:
        _kill(proc)


def test_launcher_and_layout_errors_name_the_field(monkeypatch):
    """Unusable launcher arguments, environment and layouts raise ValueErrors naming the field."""
    def args(*a):
        return check_args(build_parser().parse_args(list(a)))
    for bad, field in ((["--nproc", "0", "--", "x.py"], "--nproc"),
                       (["--nproc", "2", "--devices-per-process", "0", "--", "x.py"], "--devices-per-process"),
                       (["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--", "x.py"], "--coordinator"),
                       (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1", "--", "x.py"],
                        "--node-rank"),
                       (["--nproc", "2", "--coordinator", "nohost", "--", "x.py"], "--coordinator"),
                       (["--nproc", "2"], "no command")):
        with pytest.raises(ValueError, match=field):
            args(*bad)
    # Several hosts: host 1 of 2 runs processes 2 and 3 of 4, each on its own device group.
    a = build_parser().parse_args(["--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--coordinator", "h0:99",
                                   "--devices-per-process", "4", "--", "x.py"])
    assert args("--nproc", "2", "--", "x.py", "--flag") == ["x.py", "--flag"]
    env = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"}, a, "h0:99", 1)
    assert (env["MOEJAX_COORDINATOR"], env["MOEJAX_NUM_PROCESSES"], env["MOEJAX_PROCESS_ID"]) == ("h0:99", "4", "3")
    assert env["JAX_LOCAL_DEVICE_IDS"] == "4,5,6,7"
    cpu = child_env({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"},
                    a, "h0:99", 0)
    assert cpu["JAX_NUM_CPU_DEVICES"] == "4" and cpu["XLA_FLAGS"].split() == [
        "--other", "--xla_force_host_platform_device_count=4"]
    # The child's side: the environment is checked before jax.distributed is touched.
    monkeypatch.setenv(processes.NUM_PROCESSES_ENV, "2")
    monkeypatch.delenv(processes.PROCESS_ID_ENV, raising=False)
    with pytest.raises(ValueError, match=processes.PROCESS_ID_ENV):
        processes.initialize_from_env()
    monkeypatch.setenv(processes.PROCESS_ID_ENV, "1")
    monkeypatch.setenv(processes.COORDINATOR_ENV, "no-port")
    with pytest.raises(ValueError, match=processes.COORDINATOR_ENV):
        processes.initialize_from_env()
    monkeypatch.setenv(processes.NUM_PROCESSES_ENV, "zero")
    with pytest.raises(ValueError, match=processes.NUM_PROCESSES_ENV):
        processes.initialize_from_env()
    # A layout the processes cannot split evenly.
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    with pytest.raises(ValueError, match="data_parallel_size 8 is not divisible by the 3 processes"):
        make_mesh(8)


class _ListChannel:
    """StepChannel's interface over a list: process 0's messages, replayed later in this process."""

    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)

    def receive(self):
        return self.messages.pop(0)


def test_follower_replays_the_leaders_calls(job):
    """LeaderEngine forwards add_request (with the seed the engine drew), abort and step; ``follow`` replays
    them on another engine, which then holds the same sequences: the same sampled tokens (temperature 1,
    seeds drawn by the leader's engine), the same aborted one, and nothing left running; a follower
    whose state differs from the leader's before a step raises."""
    model = moejax.load(job[1], dtype="float32", max_model_len=96, max_num_seqs=4, num_kv_blocks=24, progress=False)
    channel = _ListChannel()
    leader = LeaderEngine(model.engine, channel)
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True)
    seqs = [leader.add_request(p, sp) for p in job[2]["prompts"][:3]]
    leader.step(), leader.step()
    leader.abort(seqs[1])
    while leader.has_unfinished():
        leader.step()
    leader.stop_followers()

    # A second engine (its own scheduler, blocks and sequences) on the same runner: the leader is done with it.
    base = model.engine
    follower = LLMEngine(model.config, base.runner, model.tokenizer, tuple(base.eos_token_ids), base.balancer)
    replayed = []
    add = follower.add_request
    follower.add_request = lambda *a, **k: replayed.append(add(*a, **k)) or replayed[-1]  # keeps what follow() adds
    follow(follower, channel)
    assert not channel.messages and not follower.has_unfinished()
    assert [s.seed for s in replayed] == [s.seed for s in seqs]
    assert [s.token_ids for s in replayed] == [s.token_ids for s in seqs]
    assert [s.finish_reason for s in replayed] == [s.finish_reason for s in seqs] == ["length", "abort", "length"]
    # A follower whose engine is not in the leader's state refuses to step (it would feed the collectives
    # other inputs): here one request the leader never sent.
    channel.messages = [[("step", state_digest(follower))]]
    follower.add_request([8, 9], sp)
    with pytest.raises(RuntimeError, match="differs from process 0's"):
        follow(follower, channel)


def test_leader_shares_n_samples_prompt(job):
    """The multi-process server's process 0 (its LeaderEngine behind the HTTP front end) serves n = 3 with the
    prompt prefilled once: samples 2 and 3 wait for its blocks and compute only what the prefix cache lacks
    (the prompt's last block), counted in prefilled tokens; a follower replaying the calls holds the samples
    back the same way (the same prefilled tokens and sampled tokens, its state digest equal before every step)."""
    kw = dict(dtype="float32", max_model_len=96, max_num_seqs=4, num_kv_blocks=24, block_size=16, progress=False)
    model = moejax.load(job[1], **kw)
    channel = _ListChannel()
    app, _ = make_app(model, "mp-n", engine=LeaderEngine(model.engine, channel))
    rng = np.random.default_rng()
    prompt = rng.integers(2, 300, size=int(rng.integers(40, 70))).tolist()
    srv = ServerThread(app=app).start()
    try:
        before = model.engine.stats.prefill_tokens
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(
            {"model": "mp-n", "prompt": prompt, "n": 3, "max_tokens": 4, "temperature": 1.0,
             "seed": int(rng.integers(1 << 30)), "ignore_eos": True, "return_token_ids": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        prefilled = model.engine.stats.prefill_tokens - before
    finally:
        srv.stop()
    L = len(prompt)
    # the first sample the whole prompt; each other one what follows the full blocks before the last token
    assert prefilled == L + 2 * (L - (L - 1) // 16 * 16), (prefilled, L)
    got = [c["token_ids"] for c in body["choices"]]
    assert len(got) == 3 and all(len(t) == 4 for t in got)

    base = model.engine
    follower = LLMEngine(model.config, base.runner, model.tokenizer, tuple(base.eos_token_ids), base.balancer)
    replayed = []
    add = follower.add_request
    follower.add_request = lambda *a, **k: replayed.append(add(*a, **k)) or replayed[-1]
    channel.messages.append([("stop",)])
    follow(follower, channel)
    assert follower.stats.prefill_tokens == prefilled
    assert [s.output_ids for s in replayed] == got
