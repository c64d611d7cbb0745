"""Scheduling policies (moejax/engine/scheduling_policy.py): prefill-first, interleave:N, token-budget:T.

Every policy gives the same tokens and logprobs (greedy and seeded requests; prompts of several lengths, one
chunked, requests added while others decode), with async scheduling off and on; each keeps its bound on the
prefill steps between two decode steps; ``prefill_ready()`` agrees with ``schedule()`` at every step (with
the model, and in a host-only simulation with prefix-cache hits and preemption); bad values are refused
naming ``scheduling_policy``."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import moejax
from moejax.config import EngineConfig
from moejax.engine.block_manager import BlockManager
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.scheduler import Scheduler
from moejax.engine.scheduling_policy import SchedulingPolicy, canonical
from moejax.engine.sequence import Sequence
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

POLICIES = ("prefill-first", "interleave:1", "interleave:2", "token-budget:20")
MAX_PREFILL = 32  # the 70-token prompt goes in chunks of 32, 32, 6; a chunk of 32 is over token-budget:20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(synchronous, overlapped) engines of one tiny checkpoint, loaded with a policy (each test sets its own)."""
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=17, std=0.1)
    kw = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_prefill_tokens=MAX_PREFILL,
              enable_prefix_caching=False, progress=False, scheduling_policy="interleave:03")
    return moejax.load(path, async_scheduling=False, **kw), moejax.load(path, async_scheduling=True, **kw)


def _schedule_log(sch: Scheduler, check_ready: bool) -> list[tuple]:
    """Records every schedule() decision: (kind, prompt tokens or decode batch, sequences, whether sequences
    were decoding, whether it left a prompt part-way). ``check_ready``: prefill_ready() is asked first and
    must agree (with async scheduling the engine itself checks it where it matters)."""
    log = []
    schedule = sch.schedule

    def logged():
        ready = sch.prefill_ready() if check_ready else None
        decoding = bool(sch.running)
        kind, seqs = schedule()
        assert ready is None or ready == (kind == "prefill"), (ready, kind, sch.policy)
        part_way = any(s.num_cached_tokens + s.num_new_tokens < len(s) for s in seqs) if kind == "prefill" else False
        log.append((kind, sum(s.num_new_tokens for s in seqs) if kind == "prefill" else len(seqs), len(seqs),
                    decoding, part_way))
        return kind, seqs

    sch.schedule = logged
    return log


def check_bounds(log: list[tuple], spec: str) -> dict:
    """Asserts the policy's bound over a schedule log; returns what the workload exercised."""
    kind, _, limit = spec.partition(":")
    limit = int(limit) if limit else None
    steps = tokens = 0  # since the last time the scheduler went to the decode queue
    part_way = False
    seen = {"prefills_in_a_row_while_decoding": 0, "alone_over_budget": 0, "chunk_yields": 0}
    for k, n, nseqs, decoding, left_part_way in log:
        if k != "prefill":
            seen["chunk_yields"] += part_way and k == "decode"
            steps = tokens = 0
            part_way = False
            continue
        if decoding:
            assert not part_way, "a chunk left its prompt part-way: a decode step comes next"
            seen["prefills_in_a_row_while_decoding"] = max(seen["prefills_in_a_row_while_decoding"], steps + 1)
            if kind == "interleave":
                assert steps < limit, (spec, log)
            if kind == "token-budget":
                assert tokens + n <= limit or (steps == 0 and nseqs == 1), (spec, log)
                seen["alone_over_budget"] += n > limit
        steps, tokens, part_way = steps + 1, tokens + n, left_part_way
    return seen


def _workload(rng):
    """(arrival step, prompt, params): two short prompts first, then a long one (chunked) with a short one,
    then a burst of four (more than one prefill step holds) and two more, all while others decode."""
    arrivals = [(0, 5), (0, 11), (2, 70), (2, 9), (5, 12), (5, 13), (5, 14), (5, 6), (9, 20), (9, 3)]
    out = []
    for i, (step, n) in enumerate(arrivals):
        sample = dict(temperature=0.9, top_p=0.9, top_k=40, seed=int(rng.integers(1 << 30))) if i % 2 else {}
        params = SamplingParams(max_new_tokens=int(rng.integers(6, 15)), ignore_eos=True, logprobs=True, **sample)
        out.append((step, rng.integers(2, 320, size=n).tolist(), params))
    return out


def _run(model, spec, workload):
    eng = model.engine
    eng.scheduler.policy = SchedulingPolicy(spec)
    log = _schedule_log(eng.scheduler, check_ready=not eng.async_scheduling)
    try:
        seqs, step = [], 0
        while len(seqs) < len(workload) or any(not s.is_finished for s in seqs):
            seqs += [eng.add_request(p, sp) for t, p, sp in workload if t == step]
            kind, _ = eng.step()
            assert kind != "idle" or all(s.is_finished for s in seqs)
            step += 1
    finally:
        del eng.scheduler.schedule  # the class's again
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [(s.output_ids, s.logprobs, s.finish_reason) for s in seqs], log


def test_every_policy_gives_the_same_tokens_and_keeps_its_bound(models):
    """The mixed workload under each policy, async scheduling off and on: the same tokens (exactly) and
    logprobs as prefill-first without async scheduling; each schedule keeps its policy's bound
    (interleave:1 never runs two prefill steps in a row while sequences decode; token-budget:20 never
    prefills more than 20 prompt tokens between decode steps but for one prompt chunk alone); a chunk that
    leaves its prompt part-way is followed by a decode step under every policy."""
    sync, overlapped = models
    assert sync.config.scheduler.scheduling_policy == "interleave:3"  # moejax.load passes it through
    assert sync.engine.scheduler.policy.spec == "interleave:3"
    workload = _workload(np.random.default_rng())
    want, _ = _run(sync, "prefill-first", workload)
    for model in (sync, overlapped):
        for spec in POLICIES:
            got, log = _run(model, spec, workload)
            for g, w in zip(got, want):
                assert g[0] == w[0] and g[2] == w[2], (spec, model.engine.async_scheduling, g, w)
                np.testing.assert_allclose(g[1], w[1], rtol=1e-5, atol=1e-5)
            seen = check_bounds(log, spec)
            assert seen["chunk_yields"] >= 1, (spec, log)  # the long prompt's chunks did yield
            if spec == "prefill-first":  # the workload makes the policies differ
                assert seen["prefills_in_a_row_while_decoding"] >= 3, log
            if spec.startswith("token-budget"):
                assert seen["alone_over_budget"] >= 1, log  # a 32-token chunk ran, alone
            if spec.startswith("interleave"):
                assert seen["prefills_in_a_row_while_decoding"] == int(spec.split(":")[1]), log


def _simulate(spec, prompts, arrivals, max_new, num_blocks, block_size=4, max_num_seqs=4, max_prefill=16):
    """The scheduler alone, with the engine's bookkeeping and a stand-in model (each token a function of the
    sequence's length): prefill_ready() asked before every schedule() must agree with it."""
    blocks = BlockManager(num_blocks, block_size, 1, max_num_seqs, enable_prefix_caching=True)
    sch = Scheduler(blocks, max_num_seqs, max_prefill, max_preemptions=1000, max_model_len=64,
                    scheduling_policy=spec)
    log = _schedule_log(sch, check_ready=True)
    seqs, step = [], 0
    while len(seqs) < len(prompts) or sch.has_work():
        for p, t in zip(prompts, arrivals):
            if t == step:
                seqs.append(Sequence(p, SamplingParams(max_new_tokens=max_new), seed=0))
                sch.add(seqs[-1])
        step += 1
        kind, batch = sch.schedule()
        if kind == "idle":
            continue
        if kind == "prefill":
            for s in batch:
                s.num_cached_tokens += s.num_new_tokens
            batch = [s for s in batch if s.prefill_done]
            sch.prefilled(batch)
        else:
            for s in batch:
                s.num_cached_tokens = len(s)
        for s in batch:
            blocks.cache_computed(s)
            s.token_ids.append((len(s) * 7) % 50)
            if s.num_output_tokens >= max_new:
                sch.finish(s)
        assert step < 10_000
    return [s.output_ids for s in seqs], log, sch


@pytest.mark.parametrize("spec", [*POLICIES, "interleave:3", "token-budget:1", "token-budget:9"])
def test_prefill_ready_agrees_with_schedule_host_only(spec):
    """Random workloads through the scheduler alone (no model): prompts sharing prefixes (prefix-cache hits
    count no tokens), long ones chunked, a cache small enough to preempt; prefill_ready() agrees with
    schedule() at every step, the policy's bound holds, every sequence finishes with the same tokens."""
    rng = np.random.default_rng()
    for _ in range(20):
        base = rng.integers(0, 50, size=24).tolist()
        n = int(rng.integers(4, 12))
        prompts = [base[:int(rng.integers(1, 24))] + rng.integers(0, 50, size=int(rng.integers(0, 30))).tolist()
                   for _ in range(n)]
        prompts = [p or [1] for p in prompts]
        arrivals = sorted(int(t) for t in rng.integers(0, 40, size=n))
        max_new = int(rng.integers(1, 10))
        want, _, _ = _simulate("prefill-first", prompts, arrivals, max_new, num_blocks=64)
        got, log, sch = _simulate(spec, prompts, arrivals, max_new, num_blocks=int(rng.integers(17, 64)))
        assert got == want
        check_bounds(log, spec)
        assert sch.blocks.num_free == sch.blocks.num_blocks


@pytest.mark.parametrize("bad", ["interleave:0", "foo", "token-budget:x", "token-budget:", "interleave",
                                 "interleave:-1", "token-budget:1.5", "prefill-first:2", "", None, 3])
def test_bad_policies_are_named(bad):
    """A bad value is a ValueError naming scheduling_policy and listing the options, from EngineConfig.create
    (moejax.load's check); scripts/serve.py refuses it as a usage error."""
    cfg = moejax.parse_model_config(preset("v3-tiny"))
    with pytest.raises(ValueError, match="scheduling_policy") as e:
        EngineConfig.create(cfg, scheduling_policy=bad)
    for option in ("prefill-first", "interleave:N", "token-budget:T"):
        assert option in str(e.value)
    if isinstance(bad, str):
        spec = importlib.util.spec_from_file_location("moejax_serve_script",
                                                      Path(__file__).parent.parent / "scripts" / "serve.py")
        serve = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(serve)
        with pytest.raises(SystemExit):
            serve.build_parser().parse_args(["--scheduling-policy", bad])


def test_good_policies_are_kept_canonical():
    cfg = moejax.parse_model_config(preset("v3-tiny"))
    assert EngineConfig.create(cfg).scheduler.scheduling_policy == "prefill-first"
    for spec, want in (("interleave:1", "interleave:1"), ("token-budget:0512", "token-budget:512")):
        assert EngineConfig.create(cfg, scheduling_policy=spec).scheduler.scheduling_policy == want == canonical(spec)
