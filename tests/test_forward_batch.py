"""moejax/layers/forward_batch.py: the batch object the model passes from the causal LM to attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.layers.forward_batch import ForwardBatch


def test_the_prefill_form_follows_its_arguments_and_refuses_what_is_missing():
    pos, lens = jnp.zeros((2, 3), jnp.int32), jnp.array([3, 2], jnp.int32)
    tables, slots = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    assert ForwardBatch.prefill(pos, lens).mode == "dense"
    paged = ForwardBatch.prefill(pos, lens, slots, tables, block_size=16)
    assert paged.mode == "paged" and paged.ctx_lens is lens  # a chunk that ends its context
    assert ForwardBatch.prefill(pos.reshape(-1), slots=slots.reshape(-1), cu_seqlens=jnp.array([0, 3, 5])).mode == \
        "packed"
    with pytest.raises(ValueError, match="block_size"):
        ForwardBatch.prefill(pos, lens, slots, tables)
    with pytest.raises(ValueError, match="do not combine"):
        ForwardBatch.prefill(pos, lens, slots, tables, block_size=16, cu_seqlens=jnp.array([0, 6]))
    with pytest.raises(ValueError, match="slots"):
        ForwardBatch.decode(pos[:, 0], None, tables, lens, 16)
    with pytest.raises(ValueError, match="mode"):
        ForwardBatch("chunked", pos)


def test_a_pytree_whose_form_and_block_size_are_static():
    """The arrays are leaves (traced under jit); mode and block_size are part of the tree's structure, so a
    different form or block size is another program."""
    rng = np.random.default_rng(0)
    b = ForwardBatch.decode(*(jnp.asarray(rng.integers(0, 9, (4,)), jnp.int32) for _ in range(2)),
                            jnp.zeros((4, 2), jnp.int32), jnp.full((4,), 3, jnp.int32), 16)
    assert len(jax.tree.leaves(b)) == 4
    traces = []

    @jax.jit
    def f(batch):
        traces.append(batch.block_size)
        return batch.positions + batch.block_size

    np.testing.assert_array_equal(f(b), np.asarray(b.positions) + 16)
    f(b.replace(positions=b.positions + 1))
    f(b.replace(block_size=32))
    assert traces == [16, 32]
    real = b.real_tokens(jnp.zeros((1, 8, 2)), 4)
    np.testing.assert_array_equal(real, np.asarray(b.slots) < 8)
