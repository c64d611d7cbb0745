"""Prefill/decode handoff (kv_handoff.py) between engines of different parallel layouts: a dp2-ep2 mesh
engine (its cache sharded over 2 ranks on 2 of the host devices) and a one-device engine, each way round,
give the colocated engine's tokens for greedy and seeded sampling, with different block sizes; through
the server's engine threads (AsyncEngine handoff / prefilled requests) a decode engine without room
parks requests, never drops them."""

import asyncio

import numpy as np
import pytest

import moejax
from moejax.engine.kv_handoff import add_prefilled, take_prefilled
from moejax.engine.sampling_params import SamplingParams
from moejax.server.async_engine import AsyncEngine
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

KW = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "progress": False}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(mesh, plain): a dp2-ep2 engine (block 16) and a one-device one (block 8); no prefix cache, so a
    prompt run twice is computed twice alike."""
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("tiny")), preset("v3-tiny"), seed=11, std=0.1)
    mesh = moejax.load(path, block_size=16, parallel="dp2-ep2", enable_prefix_caching=False, kv_role="both",
                       **KW).engine  # both ways: each engine exports and imports
    return mesh, moejax.load(path, block_size=8, enable_prefix_caching=False, kv_role="both", **KW).engine


def _run(engine, prompts, params):
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [s.output_ids for s in seqs]


def _handoff(a, b, prompts, params):
    seqs = [a.add_request(p, sp) for p, sp in zip(prompts, params)]
    moved = {}
    while len(moved) < len(seqs):
        for s in a.step()[1]:
            moved[s.seq_id] = s if s.is_finished else add_prefilled(b, take_prefilled(a, s))
    out = [moved[s.seq_id] for s in seqs]
    while any(not s.is_finished for s in out):
        b.step()
    assert a.blocks.num_free == a.blocks.num_blocks and b.blocks.num_free == b.blocks.num_blocks
    return [s.output_ids for s in out]


def test_mesh_and_one_device_engines_hand_over_both_ways(engines):
    """Reference: each prefilling engine alone (colocated). dp2-ep2 -> one device and one device -> dp2-ep2
    (sequences placed on both ranks): the same token ids, greedy and seeded."""
    mesh, plain = engines
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 320, size=int(rng.integers(3, 40))).tolist() for _ in range(4)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(2, 10)), ignore_eos=True,
                             **(dict(temperature=0.9, top_p=0.9, seed=int(rng.integers(1 << 30))) if i % 2 else {}))
              for i in range(4)]
    assert _handoff(mesh, plain, prompts, params) == _run(mesh, prompts, params)
    want = _run(plain, prompts, params)
    seen_ranks = set()
    got = _handoff(plain, _RankSpy(mesh, seen_ranks), prompts, params)
    assert got == want and seen_ranks == {0, 1}


class _RankSpy:
    """The engine, recording the rank each added sequence is placed on (both ranks must be exercised)."""

    def __init__(self, engine, ranks: set):
        self._engine, self._ranks = engine, ranks

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self._ranks.update(s.dp_rank for s in self._engine.scheduler.running)
        return self._engine.step()


def test_engine_threads_hand_over_and_park_without_room(engines):
    """Reference: the mesh engine alone (colocated). Through the server's engine threads (AsyncEngine:
    handoff requests on the mesh engine, prefilled ones on the one-device engine), 6 requests at once into
    the decode engine's 4 sequence slots: those without room are parked, not dropped, and every request
    gives the colocated tokens (the first from the prefill engine, the rest from the decode engine)."""
    mesh, plain = engines
    rng = np.random.default_rng()
    prompts = [rng.integers(2, 320, size=int(rng.integers(3, 20))).tolist() for _ in range(6)]
    # Long enough that no decode finishes while the six are being added (all at once: gather below), so
    # two of them always find the four slots taken and park.
    params = [SamplingParams(max_new_tokens=int(rng.integers(12, 17)), ignore_eos=True,
                             **(dict(temperature=0.8, seed=int(rng.integers(1 << 30))) if i % 2 else {}))
              for i in range(6)]
    want = _run(mesh, prompts, params)

    async def run():
        pa, pb = AsyncEngine(mesh).start(), AsyncEngine(plain).start()
        try:
            firsts, handoffs = [], []
            for p, sp in zip(prompts, params):
                ev = await (await pa.add_request(p, sp, handoff=True)).get(120)
                assert ev is not None and ev.handoff is not None and ev.finish_reason is None
                firsts.append(ev.token_id)
                handoffs.append(ev.handoff)
            streams = await asyncio.gather(*(pb.add_request(h.token_ids, h.params, prefilled=h) for h in handoffs))
            outs = []
            for first, st in zip(firsts, streams):
                toks = [first]
                while True:
                    ev = await st.get(120)
                    assert ev is not None and ev.error is None
                    toks.append(ev.token_id)
                    if ev.finish_reason is not None:
                        break
                outs.append(toks)
            return outs, pb.num_parked
        finally:
            pa.shutdown()
            pb.shutdown()

    outs, parked = asyncio.run(run())
    assert outs == want
    assert parked >= 2
