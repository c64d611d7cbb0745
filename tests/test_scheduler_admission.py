"""The scheduler admits a sequence another engine prefilled (engine/kv_handoff.py): a slot and blocks are
its rule, the prefix-cache counts are its own, and a failed row write leaves nothing behind."""

import numpy as np
import pytest

from moejax.engine.block_manager import BlockManager
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.scheduler import Scheduler
from moejax.engine.sequence import Sequence, Status


def _prefilled(rng, n):
    seq = Sequence(rng.integers(0, 100, n).tolist(), SamplingParams(), 0)
    seq.num_prompt_tokens = n - 1
    return seq


def test_admit_prefilled_counts_and_rolls_back():
    rng = np.random.default_rng()
    blocks = BlockManager(8, 4, enable_prefix_caching=True)
    sch = Scheduler(blocks, max_num_seqs=2, max_prefill_tokens=16)
    a = _prefilled(rng, 10)
    assert sch.can_admit_prefilled(a)
    filled = []

    def fill(hit):
        filled.append(hit)
        a.num_cached_tokens = len(a) - 1

    sch.admit_prefilled(a, fill)
    assert filled == [0] and sch.running == [a] and a.status == Status.RUNNING
    assert (sch.prefix_cache_queries, sch.prefix_cache_hits) == (10, 0)
    # The same tokens again: its full blocks (two of 4 tokens) are prefix-cache hits here now.
    b = Sequence(list(a.token_ids), SamplingParams(), 0)
    free = blocks.num_free

    def broken(hit):
        filled.append(hit)
        raise RuntimeError("rows did not fit")

    with pytest.raises(RuntimeError, match="rows did not fit"):
        sch.admit_prefilled(b, broken)
    assert filled[-1] == 8 and sch.running == [a] and not b.block_table and blocks.num_free == free
    assert (sch.prefix_cache_queries, sch.prefix_cache_hits) == (20, 8)
    sch.admit_prefilled(b, lambda hit: None)
    assert not sch.can_admit_prefilled(_prefilled(rng, 4))  # both slots taken
