"""The KV cache's memory plan (model_runner.default_num_blocks) leaves the sampling controls' History free:
the cache gets exactly history_bytes fewer bytes than without it, and history_bytes is what ControlState
allocates (one rank's share)."""

import jax
import numpy as np
import pytest

from moejax.config import EngineConfig
from moejax.engine import model_runner
from moejax.kernels.common import pow2
from moejax.engine.sample_controls import HISTORY_DTYPE, history_bytes, history_shapes
from moejax.kernels.kv_quant import cache_array_dtype, cache_row_dim
from moejax.layers.sampler import RECENT
from moejax.models.registry import parse_model_config
from moejax.tiny.presets import preset


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def _blocks(monkeypatch, conf, stats, history):
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Device(stats)])
    monkeypatch.setattr(model_runner, "history_bytes", history)
    return model_runner.default_num_blocks(conf)


def test_plan_shrinks_by_the_history(monkeypatch):
    """On a device that reports its memory: blocks = (budget - history_bytes) // block bytes, against
    budget // block bytes without the History (budget: utilisation x limit - in use - the step reserve)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    cfg = parse_model_config(preset("v3-tiny"))
    seqs = int(rng.integers(2**16, 2**17))  # more than the memory holds at max_model_len: the budget decides
    conf = EngineConfig.create(cfg, dtype="float32", max_model_len=2048, max_num_seqs=seqs)
    limit = int(rng.integers(8, 64)) << 30
    stats = {"bytes_limit": limit, "bytes_in_use": int(rng.integers(0, limit // 8))}
    per_block = (conf.num_cache_layers * conf.cache.block_size * cache_row_dim(cfg.kv_cache_dim, "auto")
                 * cache_array_dtype("auto", "float32", conf.kernels).itemsize)
    budget = (int(conf.cache.gpu_memory_utilization * limit) - stats["bytes_in_use"]
              - model_runner.STEP_RESERVE_BYTES)
    h = history_bytes(pow2(seqs), cfg.vocab_size)
    assert h == pow2(seqs) * (cfg.vocab_size + RECENT) * 4 and h > per_block
    assert _blocks(monkeypatch, conf, stats, lambda rows, vocab: 0) == budget // per_block, seed
    assert _blocks(monkeypatch, conf, stats, history_bytes) == (budget - h) // per_block, seed


def test_history_bytes_is_one_ranks_allocation():
    """The History's arrays (ControlState's shapes, 4 ranks) hold 4 x history_bytes."""
    rows, vocab = 256, 129280  # DeepSeek-V3's vocabulary at 256 rows: about 132 MB a rank
    total = sum(int(np.prod(s)) for s in history_shapes(4, rows, vocab)) * np.dtype(HISTORY_DTYPE).itemsize
    assert total == 4 * history_bytes(rows, vocab)
    assert history_bytes(rows, vocab) == pytest.approx(132.4e6, rel=1e-3)
