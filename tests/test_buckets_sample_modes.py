"""The sampler modes merged where a program's compile costs more than its work (buckets.Buckets.sample_mode,
compile_bound: XLA:CPU): a batch runs the program with top logprobs whatever it asks, and its tokens and
logprobs are those of its own mode's program (the host keeps top logprobs only for the rows asking them:
model_runner's outputs). Fresh random logits each run (conftest's seed, printed with a failure)."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.engine.buckets import Buckets
from moejax.layers.sampler import MAX_TOP_LOGPROBS, SampleMode, sample


@pytest.mark.parametrize("mode", [m for m in SampleMode.all() if not m.controls], ids=str)
def test_merged_mode_samples_the_same_tokens_and_logprobs(mode):
    b = Buckets(max_num_seqs=8, max_prefill_tokens=64, max_blocks_per_seq=8, decode_width_scales=True,
                compile_bound=True)
    merged = b.sample_mode(mode)
    assert merged in b.sample_modes() and merged.top and merged._replace(top=mode.top) == mode
    rng = np.random.default_rng()
    B, V = 48, 320
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32) * 3)
    temp = jnp.asarray(np.where(rng.random(B) < 0.3, 0.0, rng.uniform(0.3, 1.5, B)) if mode.random
                       else np.zeros(B), jnp.float32)
    top_p = jnp.asarray(np.where(rng.random(B) < 0.5, rng.uniform(0.5, 0.95, B), 1.0), jnp.float32)
    top_k = jnp.asarray(np.where(rng.random(B) < 0.5, rng.integers(1, 40, B), 0), jnp.int32)
    seeds = jnp.asarray(rng.integers(0, 1 << 32, size=B, dtype=np.uint64).astype(np.uint32))
    pos = jnp.asarray(rng.integers(0, 2048, size=B), jnp.int32)
    own = sample(logits, temp, top_p, top_k, seeds, pos, mode)
    run = sample(logits, temp, top_p, top_k, seeds, pos, merged)
    np.testing.assert_array_equal(np.asarray(run[0]), np.asarray(own[0]))  # tokens
    np.testing.assert_array_equal(np.asarray(run[1]), np.asarray(own[1]))  # their logprobs
    # The top logprobs the merged program computes are the raw distribution's best (NumPy reference).
    lp = np.asarray(logits, np.float64)
    lp = lp - lp.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    K = min(MAX_TOP_LOGPROBS, V)
    np.testing.assert_allclose(np.asarray(run[2]), -np.sort(-lp, axis=-1)[:, :K], rtol=1e-5, atol=1e-5)
    if mode.random:
        assert len(set(np.asarray(run[0]).tolist())) > 5  # the draws do vary


def test_not_compile_bound_keeps_every_mode():
    b = Buckets(max_num_seqs=8, max_prefill_tokens=64, max_blocks_per_seq=8, decode_width_scales=True)
    assert b.sample_modes() == SampleMode.all()
    assert all(b.sample_mode(m) == m for m in SampleMode.all())
