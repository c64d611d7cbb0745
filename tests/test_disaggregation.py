"""Prefill/decode disaggregation against the colocated engine: a sequence prefilled by engine A and
decoded by engine B (kv_handoff.py; other block sizes, bf16-valued and FP8 caches, B's prefix cache)
gives exactly the tokens, logprobs and texts of one engine for greedy and seeded sampling; rows moved
between two processes (kv_transfer.py, jax.experimental.transfer) arrive bit for bit; a failed pull
raises KVTransferFailed within its deadline and the request, prefilled again, completes with the
colocated engine's tokens."""

import hashlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.engine.kv_handoff import PrefilledRequest, add_prefilled, take_prefilled
from moejax.engine.kv_transfer import KVTransfer, KVTransferFailed
from moejax.engine.sampling_params import SamplingParams
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disagg_prefill_worker.py")
KW = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "progress": False}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=13, std=0.1)


@pytest.fixture(scope="module")
def engines(tiny_path):
    """kv dtype -> (A, B): A prefills (block 16) and, alone, is the colocated reference (no prefix cache,
    so its second run of a prompt is computed as its first); B decodes (block 4 with async scheduling,
    or 8; prefix cache on)."""
    def pair(kv, b_block, b_async):
        a = moejax.load(tiny_path, block_size=16, kv_cache_dtype=kv, enable_prefix_caching=False, kv_role="prefill",
                        **KW).engine
        return a, moejax.load(tiny_path, block_size=b_block, kv_cache_dtype=kv, async_scheduling=b_async,
                              kv_role="decode", **KW).engine
    return {"auto": pair("auto", 4, True), "fp8": pair("fp8", 8, False)}


@pytest.fixture(scope="module")
def worker(tiny_path):
    """A separate prefill process (tests/disagg_prefill_worker.py): send a command, read its answer."""
    proc = subprocess.Popen([sys.executable, WORKER, tiny_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "KV_CACHE_DTYPE": "auto"})

    def ask(cmd: dict) -> dict:
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the worker exited ({proc.poll()})"
        return json.loads(line)

    yield ask
    proc.stdin.close()
    proc.wait(30)


def _requests(rng, n=5):
    """Greedy and seeded requests alternating (logprobs and top logprobs asked); prompt 1 shares prompt 0's
    first 20 tokens (a prefix-cache hit on the decode side: neither ends at its first token); one request
    has a stop string."""
    prompts = [rng.integers(2, 320, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]
    prompts[0] = rng.integers(2, 320, size=30).tolist()
    prompts[1] = prompts[0][:20] + prompts[1]
    params = []
    for i in range(n):
        sample = dict(temperature=0.9, top_p=0.85, top_k=40, seed=int(rng.integers(1 << 30))) if i % 2 else {}
        params.append(SamplingParams(max_new_tokens=int(rng.integers(2 if i < 2 else 1, 16)), logprobs=True,
                                     top_logprobs=2, ignore_eos=True, stop=["zz"] if i == 3 else [], **sample))
    return prompts, params


def _result(s):
    return s.output_ids, list(s.logprobs), s.top_logprobs, s.finish_reason, s.text


def _colocated(engine, prompts, params):
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [_result(s) for s in seqs]


def _disaggregated(a, b, prompts, params):
    """Every request prefilled by ``a``, taken out right after its prefill step, decoded by ``b``."""
    seqs = [a.add_request(p, sp) for p, sp in zip(prompts, params)]
    moved = {}
    while len(moved) < len(seqs):
        kind, stepped = a.step()
        assert kind == "prefill"  # every sequence leaves before a decode step
        for s in stepped:
            moved[s.seq_id] = s if s.is_finished else add_prefilled(b, take_prefilled(a, s))
    assert not a.has_unfinished() and a.blocks.num_free == a.blocks.num_blocks
    out = [moved[s.seq_id] for s in seqs]
    while any(not s.is_finished for s in out):
        b.step()
    assert b.blocks.num_free == b.blocks.num_blocks
    return [_result(s) for s in out]


def _assert_same(got, want, exact_logprobs):
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[3:] == w[3:], (g, w)
        if exact_logprobs:
            assert g[1] == w[1]
        np.testing.assert_allclose(g[1], w[1], rtol=1e-5, atol=1e-5)
        assert [[t for t, _ in x] for x in g[2]] == [[t for t, _ in x] for x in w[2]]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_handoff_gives_colocated_tokens(engines, kv):
    """Reference: engine A alone. Prefilled on A (block 16), decoded on B (block 4 with async scheduling, or
    8): the same token ids, top-logprob tokens, finish reasons and texts for greedy and seeded sampling
    (FP8: logprobs bit-equal; float32: within 1e-5, B's decode batches are padded differently); B's prefix
    cache serves the shared prompt prefix; export/import compile once per row bucket."""
    a, b = engines[kv]
    prompts, params = _requests(np.random.default_rng())
    want = _colocated(a, prompts, params)
    hits0 = b.scheduler.prefix_cache_hits
    got = _disaggregated(a, b, prompts, params)
    _assert_same(got, want, exact_logprobs=kv == "fp8")
    assert b.scheduler.prefix_cache_hits - hits0 >= 16  # prompt 1's first block (at least) was B's already
    assert a.runner.trace_counts["export_rows"] <= 3 and b.runner.trace_counts["import_rows"] <= 3  # 16/32/64


def test_handoff_keeps_the_structured_output(engines):
    """A constrained request prefilled on A and decoded on B: B's matcher catches up on the first token, so the
    tokens are the colocated ones and the answers match their constraints (greedy and seeded)."""
    pytest.importorskip("xgrammar")
    import json
    import re
    from moejax.structured_output import Constraint
    a, b = engines["auto"]
    cons = [Constraint("regex", "(yes|no)-[0-9]{2,4}"), Constraint.choice(["alpha", "beta", "gamma"])]
    params = [SamplingParams(max_new_tokens=20, temperature=float(i % 2), seed=i, structured_outputs=cons[i % 2])
              for i in range(4)]
    prompts = [[5 + i, 40, 77] for i in range(4)]
    want = _colocated(a, prompts, params)
    while a.step()[0] != "idle":  # answers ended by EOS leave a step in flight (async scheduling): read it
        pass
    got = _disaggregated(a, b, prompts, params)
    _assert_same(got, want, exact_logprobs=False)
    for (ids, _, _, reason, text), sp in zip(got, params):
        c = sp.structured_outputs
        assert reason == "stop"
        assert (re.fullmatch(c.spec, text) if c.kind == "regex" else text in json.loads(c.spec)), text


def test_handoff_rejects_rows_of_another_cache(engines):
    """Invariant: FP8 rows into a bf16-valued cache (or the reverse) are refused with a ValueError naming
    kv_cache_dtype, before anything is allocated; metadata without a field names that field."""
    a8, _ = engines["fp8"]
    _, b = engines["auto"]
    seq = a8.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while seq.num_output_tokens == 0:
        a8.step()
    req = take_prefilled(a8, seq)
    free = b.blocks.num_free
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        add_prefilled(b, req)
    assert b.blocks.num_free == free
    meta = req.meta()
    del meta["seed"]
    with pytest.raises(ValueError, match="'seed'"):
        PrefilledRequest.from_meta(meta)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_rows_cross_processes_bit_exact(worker, dtype):
    """Reference: the rows' bytes hashed in the offering process. Rows of every byte pattern (FP8: NaN
    patterns and scale bytes included) pulled by this process through jax.experimental.transfer hash the
    same; DeepSeek-V3-like row widths (592 FP8 / 576 bf16)."""
    shape = [3, 64, 592 if dtype.startswith("float8") else 576]
    seed = int(np.random.default_rng().integers(1 << 30))
    ans = worker({"op": "rows", "shape": shape, "dtype": dtype, "seed": seed})
    xfer = _local_transfer()
    rows = xfer.pull(ans["transfer"]["address"], ans["transfer"]["uuid"], shape, dtype, timeout_s=30)
    got = hashlib.sha256(np.asarray(jax.lax.bitcast_convert_type(rows, jnp.uint8)).tobytes())
    assert rows.dtype == jnp.dtype(dtype) and got.hexdigest() == ans["sha256"]


_XFER = []


def _local_transfer() -> KVTransfer:
    if not _XFER:
        _XFER.append(KVTransfer())
    return _XFER[0]


def test_prefill_process_to_decode_engine_and_failed_pull_requeued(worker, engines):
    """Reference: engine A alone (colocated). Requests prefilled in another process and pulled here into
    B: the same tokens. An injected failure (a pull of a uuid never offered, deadline 1 s) raises
    KVTransferFailed within seconds; the request, prefilled again, then completes with A's tokens."""
    a, b = engines["auto"]
    rng = np.random.default_rng()
    prompts, params = _requests(rng, 3)
    want = _colocated(a, prompts, params)
    xfer = _local_transfer()
    got = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        attempts = 0
        while True:
            attempts += 1
            meta = worker({"op": "prefill", "prompt": p, "params": _params_json(sp)})
            if "finished" in meta:
                got.append(meta["finished"])
                break
            if i == 0 and attempts == 1:  # the injected failure: the offered rows are never pulled
                meta = {**meta, "transfer": {**meta["transfer"], "uuid": meta["transfer"]["uuid"] ^ 1}}
                t0 = time.perf_counter()
                with pytest.raises(KVTransferFailed):
                    xfer.pull_request(meta, timeout_s=1.0)
                assert time.perf_counter() - t0 < 10
                continue  # re-queued: prefilled again
            req, stats = xfer.pull_request(meta)
            assert stats["bytes"] == req.rows.nbytes > 0
            seq = add_prefilled(b, req)
            while not seq.is_finished:
                b.step()
            got.append(seq.output_ids)
            break
        if i == 0:
            assert attempts == 2
    assert got == [w[0] for w in want]


def _params_json(sp: SamplingParams) -> dict:
    return {k: getattr(sp, k) for k in sp.__dataclass_fields__}



# ----- speculative decoding (MTP) on the decode side (issue 32) -------------------------------------------
SPEC_KW = {"dtype": "float32", "max_model_len": 96, "max_num_seqs": 4, "max_prefill_tokens": 64, "progress": False}
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def mtp_engines(tmp_path_factory):
    """v3-tiny with its MTP layer: R, the non-speculative colocated reference (block 16, no prefix cache; also a
    prefill side without speculation and a decode side without it); A, a speculative prefill side (k 2,
    block 16); B, a speculative decode side (k 2, block 8, prefix cache on)."""
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("mtp")), preset("v3-tiny", num_nextn_predict_layers=1),
                                  seed=13, std=0.1)
    r = moejax.load(path, block_size=16, enable_prefix_caching=False, kv_role="both", **SPEC_KW).engine
    a = moejax.load(path, block_size=16, speculative_config=MTP, kv_role="prefill", **SPEC_KW).engine
    b = moejax.load(path, block_size=8, speculative_config=MTP, kv_role="decode", **SPEC_KW).engine
    return r, a, b


def test_speculative_decode_side(mtp_engines):
    """Prefilled by a speculative engine, decoded by one (its MTP rows and first drafts carried through the
    metadata round trip; one request's drafts dropped: its first step verifies none) and by a non-speculative
    one (MTP rows dropped): the non-speculative colocated engine's tokens, greedy and seeded. A prefill side
    without speculation is refused by the speculative decode side (ValueError naming speculative_config),
    before any of its blocks is taken."""
    r, a, b = mtp_engines
    rng = np.random.default_rng(5)
    prompts, params = _requests(rng, 4)
    prompts = [p[:24] for p in prompts]
    want = _colocated(r, prompts, params)

    def via(dec, drop_drafts=()):
        seqs = [a.add_request(p, sp) for p, sp in zip(prompts, params)]
        moved = {}
        while len(moved) < len(seqs):
            _, stepped = a.step()
            for s in stepped:
                if s.is_finished:
                    moved[s.seq_id] = s
                    continue
                req = take_prefilled(a, s)
                assert len(req.drafts) == 2
                req = PrefilledRequest.from_meta(json.loads(json.dumps(req.meta())), req.rows)
                dropped = len(moved) in drop_drafts
                if dropped:
                    req.drafts = []
                moved[s.seq_id] = add_prefilled(dec, req)
                if not dec.runner.proposer.own_decode:  # the first step verifies the prefill side's drafts
                    assert len(dec.runner.proposer.drafts.get(moved[s.seq_id], ())) == (0 if dropped else 2)
        out = [moved[s.seq_id] for s in seqs]
        while any(not s.is_finished for s in out):
            dec.step()
        assert dec.blocks.num_free == dec.blocks.num_blocks
        return [_result(s) for s in out]

    drafts0 = b.stats.spec_num_draft_tokens
    _assert_same(via(b, drop_drafts=(1,)), want, exact_logprobs=False)
    assert b.stats.spec_num_draft_tokens > drafts0
    _assert_same(via(r), want, exact_logprobs=False)

    s = r.add_request(prompts[0], params[0])
    while s.num_output_tokens < 1:
        r.step()
    req = take_prefilled(r, s)
    assert req.drafts == [] and req.rows.shape[0] == 3  # v3-tiny's 3 decoder layers, no MTP rows
    free = b.blocks.num_free
    with pytest.raises(ValueError, match="speculative_config"):
        add_prefilled(b, req)
    assert b.blocks.num_free == free and not b.scheduler.running
