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


def test_the_model_takes_one_batch_and_its_forms_agree():
    """CausalLM.prefill/decode (and DeepSeek's MTP entry points) take (tokens, [previous_hidden,] batch, cache):
    a dense prefill of S + 1 tokens against the same tokens as a packed prefill of S then one decode step, in
    float32 on a tiny random V3 with its MTP layer (the runner's packed and decode forms)."""
    from moejax.tiny.presets import preset
    from moejax.model import random_model

    m = random_model(preset("v3-tiny", num_nextn_predict_layers=1), dtype="float32", max_model_len=64,
                     block_size=8, num_kv_blocks=8, kernels="xla")
    cfg, v = m.config.model, {"params": m.params, "routing": m.routing}
    rng = np.random.default_rng()
    S, bs = 11, 8
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, S + 1), jnp.int32)
    pos = jnp.arange(S + 1, dtype=jnp.int32)
    want, _ = m.module.apply(v, tokens[None], ForwardBatch.prefill(pos[None], jnp.full((1,), S + 1)), method="prefill")
    want_mtp, _ = m.module.apply(v, tokens[None, 1:], want[:, :-1], ForwardBatch.prefill(pos[None, :-1],
                                                                                          jnp.full((1,), S)),
                                 method="mtp_hidden")

    cache = jnp.zeros((cfg.num_cache_layers, 8 * bs, cfg.kv_cache_dim), jnp.float32)
    tables = jnp.array([[0, 1]], jnp.int32)
    packed = ForwardBatch.prefill(pos[:S], slots=pos[:S], cu_seqlens=jnp.array([0, S], jnp.int32))
    h, cache = m.module.apply(v, tokens[:S], packed, cache, method="prefill")
    step = ForwardBatch.decode(pos[S:], pos[S:], tables, jnp.array([S + 1], jnp.int32), bs)
    d, cache = m.module.apply(v, tokens[S:], step, cache, method="decode")
    np.testing.assert_allclose(h, want[0, :S], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d, want[0, S:], rtol=1e-4, atol=1e-4)
    # The MTP layer: rows 0..S-2 of the stream packed, the last one a decode row (its own cache layer).
    mh, cache = m.module.apply(v, tokens[1:S], h[:S - 1], packed.replace(positions=pos[:S - 1], slots=pos[:S - 1],
                                                                          cu_seqlens=jnp.array([0, S - 1])),
                               cache, method="mtp_hidden")
    md, _ = m.module.apply(v, tokens[S:], h[S - 1:], ForwardBatch.decode(pos[S - 1:S], pos[S - 1:S], tables,
                                                                          jnp.array([S], jnp.int32), bs),
                           cache, method="mtp_decode")
    np.testing.assert_allclose(mh, want_mtp[0, :S - 1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(md, want_mtp[0, S - 1:], rtol=1e-4, atol=1e-4)
