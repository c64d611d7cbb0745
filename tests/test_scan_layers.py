"""The identical MoE layers as one lax.scan on XLA:CPU (models/decoder.py ``scan_layers``): the logits and cache
rows of the unrolled layers (float32 within 1e-5: XLA may order a dot's sums differently inside the loop body,
as it may for another bucket) and the same expert statistics, exactly, through every attention form that reads
or writes the cache by layer (packed prefill, a paged chunk after it, decode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.layers.forward_batch import ForwardBatch
from moejax.models import decoder
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # four layers: the dense one, then three MoE layers (one scanned run of three)
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("v3-4")), preset("v3-tiny", num_hidden_layers=4),
                                  seed=3, std=0.1)
    return moejax.load(path, dtype="float32", max_model_len=64, max_num_seqs=4, block_size=8, num_kv_blocks=16,
                       progress=False)


def steps(m):
    """Logits of a packed prefill of two prompts (12 and 5 tokens), a paged 6-token chunk continuing the first,
    and a decode step of both; the expert counts of each; the cache after them."""
    cfg = m.config.model
    bs, nb = 8, 4
    cache = jnp.zeros((cfg.num_hidden_layers, 16 * bs, cfg.kv_cache_dim), jnp.float32)
    rng = np.random.default_rng(0)
    tables = np.arange(2 * nb, dtype=np.int32).reshape(2, nb)
    slot = lambda b, p: tables[b, p // bs] * bs + p % bs  # noqa: E731
    a, b = rng.integers(2, cfg.vocab_size, 18), rng.integers(2, cfg.vocab_size, 5)
    v = {"params": m.params, "routing": m.routing}

    def run(tokens, batch, cache, method):
        (h, cache), state = m.module.apply(v, tokens, batch, cache, method=method, mutable=["stats"])
        counts = [state["stats"][n]["mlp"]["experts"]["expert_counts"] for n in sorted(state["stats"])]
        return m.module.apply(v, h, method="logits"), counts, cache

    @jax.jit
    def all_steps(cache):
        toks = jnp.asarray(np.concatenate([a[:12], b, [0, 0, 0]]), jnp.int32)  # 3 padding tokens
        pos = jnp.asarray(np.concatenate([np.arange(12), np.arange(5), [0, 0, 0]]), jnp.int32)
        slots = jnp.asarray([*(slot(0, p) for p in range(12)), *(slot(1, p) for p in range(5)), *[16 * bs] * 3])
        packed = ForwardBatch.prefill(pos, slots=slots, cu_seqlens=jnp.asarray([0, 12, 17], jnp.int32))
        out = [run(toks, packed, cache, "prefill")]
        cache = out[-1][2]
        chunk = ForwardBatch.prefill(jnp.arange(12, 18, dtype=jnp.int32)[None], jnp.asarray([6], jnp.int32),
                                     jnp.asarray([[slot(0, p) for p in range(12, 18)]], jnp.int32),
                                     jnp.asarray(tables[:1]), jnp.asarray([18], jnp.int32), bs)
        out.append(run(jnp.asarray(a[12:18], jnp.int32)[None], chunk, cache, "prefill"))
        cache = out[-1][2]
        dec = ForwardBatch.decode(jnp.asarray([18, 5], jnp.int32), jnp.asarray([slot(0, 18), slot(1, 5)], jnp.int32),
                                  jnp.asarray(tables), jnp.asarray([19, 6], jnp.int32), bs)
        out.append(run(jnp.asarray([7, 9], jnp.int32), dec, cache, "decode"))
        return [(lg, c) for lg, c, _ in out], out[-1][2]

    return jax.tree.map(np.asarray, all_steps(cache))


def test_scanned_layers_match_unrolled(model, monkeypatch):
    layers = model.module.module if hasattr(model.module, "module") else model.module
    runs = layers.apply({"params": model.params, "routing": model.routing}, method=lambda mod: mod._layer_runs())
    assert runs == [[0], [1, 2, 3]]  # the three MoE layers as one run
    scanned = steps(model)
    monkeypatch.setattr(decoder, "scan_layers", lambda ep: False)
    runs = layers.apply({"params": model.params, "routing": model.routing}, method=lambda mod: mod._layer_runs())
    assert runs == [[0], [1], [2], [3]]
    unrolled = steps(model)
    for (lg_s, c_s), (lg_u, c_u) in zip(scanned[0], unrolled[0]):
        np.testing.assert_allclose(lg_s, lg_u, rtol=1e-5, atol=1e-5)
        assert len(c_s) == len(c_u) == 3
        for x, y in zip(c_s, c_u):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(scanned[1], unrolled[1], rtol=1e-5, atol=1e-5)  # every layer's cache rows
    assert np.abs(scanned[1][1:]).sum() > 0  # the scanned layers wrote theirs
