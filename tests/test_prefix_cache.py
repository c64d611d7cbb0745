"""Chunked prefill in the engine and automatic prefix caching: the block manager's keys,
reference counts and LRU eviction by hand; whole engines against one without either
(same tokens), a long prompt interleaved with decode steps, hits under memory pressure."""

import numpy as np
import pytest

import moejax
from moejax.engine.block_manager import BlockManager, block_hash
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.sequence import Sequence
from moejax.engine.step_log import StepLog
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

BS = 8  # KV block size of the engine tests
VOCAB = 320


def _seq(tokens):
    return Sequence(list(tokens), SamplingParams(), seed=0)


def _computed(bm, seq):
    seq.num_cached_tokens = len(seq)
    bm.cache_computed(seq)


def test_block_manager_keys_refcounts_and_lru():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(range(10))  # blocks [0-3] [4-7] [8,9]
    assert bm.allocate(a) == 0 and len(a.block_table) == 3
    _computed(bm, a)
    assert a.block_hashes == [block_hash(None, range(4)), block_hash(block_hash(None, range(4)), range(4, 8))]

    b = _seq([*range(8), 50, 51, 52])  # shares a's two full blocks
    assert bm.allocate(b) == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.num_free == 8 - 3 - 1
    # The same block of tokens after another prefix is another key: no hit.
    c = _seq([*range(4, 8), *range(4, 8), 9])
    assert bm.can_allocate(c) and bm.allocate(c) == 0
    bm.deallocate(c)

    bm.deallocate(a)  # a's shared blocks are still held by b
    assert bm.pools[0].ref[b.block_table[0]] == 1 and bm.num_free == 8 - 3
    full = _seq(range(8))  # a whole-prompt hit still leaves its last token to compute
    assert bm.allocate(full) == 4
    bm.deallocate(full)
    bm.deallocate(b)
    assert bm.num_free == 8

    # Memory pressure: a fresh 28-token prompt needs 7 of the 8 blocks. Never-used and uncached
    # blocks go first, then the least recently freed cached one (the prefix's second block,
    # freed before its first): the first block survives.
    d = _seq(range(100, 128))
    assert bm.allocate(d) == 0
    bm.deallocate(d)
    e = _seq([*range(8), 7])
    assert bm.allocate(e) == 4  # only the first block of the prefix is left
    bm.deallocate(e)
    assert bm.num_free == 8 and all(r == 0 for r in bm.pools[0].ref)

    off = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    x = _seq(range(10))
    off.allocate(x)
    _computed(off, x)
    assert off.allocate(_seq(range(10))) == 0


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    return make_random_checkpoint(d, preset("v3-tiny"), seed=5, std=0.1)


def _load(path, **kw):
    kw = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "block_size": BS, "progress": False, **kw}
    return moejax.load(path, **kw)


@pytest.fixture(scope="module")
def reference(tiny_path):
    """No prefix caching, prompts in one piece: what every other engine must reproduce."""
    return _load(tiny_path, enable_prefix_caching=False)


def _generate(m, prompts, n, seed):
    out = moejax.generate(m, prompts, max_new_tokens=n, ignore_eos=True, temperature=0.8, seed=seed)
    return [r.token_ids for r in out]


def test_chunked_prompt_interleaves_with_decode_and_matches(tiny_path, reference):
    """A 90-token prompt under a 21-token step budget is prefilled in 5 chunks (boundaries at
    odd positions, inside and across 8-token blocks) while a short request decodes: a decode step
    runs between any two of its chunks, and every sampled token equals the one-shot engine's."""
    rng = np.random.default_rng()
    short, long_ = rng.integers(2, VOCAB, size=6).tolist(), rng.integers(2, VOCAB, size=90).tolist()
    seed = int(rng.integers(1 << 30))
    want = _generate(reference, [short, long_], 12, seed)

    m = _load(tiny_path, max_prefill_tokens=21)
    eng, log = m.engine, StepLog()
    a = eng.add_request(short, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=seed))
    log.step(eng)  # the short prompt, whole
    b = eng.add_request(long_, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=seed + 1))
    while not (a.is_finished and b.is_finished):
        log.step(eng)
    kinds = [r.kind for r in log]
    chunks = [i for i, r in enumerate(log) if r.kind == "prefill"][1:]
    assert len(chunks) == 5 and [log.records[i].num_tokens for i in chunks] == [21, 21, 21, 21, 6]
    assert all(kinds[i + 1] == "decode" for i in chunks[:3])  # the running stream was not stalled
    assert [a.output_ids, b.output_ids] == want
    assert eng.runner.trace_counts["prefill_paged"] >= 1 and log.mixed_steps == 0
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_prefix_hits_same_tokens_and_eviction_loses_nothing(tiny_path, reference):
    """Prompts sharing a 40-token prefix (5 blocks) with different tails, then the same prompts
    again, through a cache too small for all of them at once: hits are counted, preemption and
    eviction happen, and the outputs equal the engine without prefix caching."""
    rng = np.random.default_rng()
    stem = rng.integers(2, VOCAB, size=40).tolist()
    prompts = [stem + rng.integers(2, VOCAB, size=int(rng.integers(1, 20))).tolist() for _ in range(6)]
    seed = int(rng.integers(1 << 30))
    want = _generate(reference, prompts, 16, seed)

    m = _load(tiny_path, num_kv_blocks=24, max_model_len=128)  # 192 slots for 6 x (41..59 + 16) tokens
    eng = m.engine
    assert _generate(m, prompts, 16, seed) == want
    first_hits = eng.stats.prefix_cache_hits
    assert first_hits >= 40 and eng.stats.prefix_cache_queries >= sum(map(len, prompts))
    assert _generate(m, prompts, 16, seed) == want  # the second round hits more
    assert eng.stats.prefix_cache_hits - first_hits >= 5 * 40
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.num_free == 24
    assert reference.engine.stats.prefix_cache_hits == 0


def test_enable_prefix_caching_is_checked(tiny_path):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        _load(tiny_path, enable_prefix_caching="yes")
