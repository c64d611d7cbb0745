"""The dense routed experts of XLA:CPU (dispatch.local_experts below DENSE_CPU_MAX_EXPERTS) against the
grouped path they replace there and a NumPy float32 reference: same sums, same pair count, padding and
replicated slots included (seed 20261207)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.layers.experts import ExpertWeights, SharedWeights
from moejax.parallel import dispatch


def _case(T=13, H=16, I=8, E=16, k=4, seed=20261207):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    wt = rng.random((T, k)).astype(np.float32)
    valid = np.arange(T) < T - 3  # three padding rows
    w = ExpertWeights(*(0.3 * rng.standard_normal(s).astype(np.float32) for s in ((E, H, I), (E, H, I), (E, I, H))))
    return x, idx, wt, valid, w


def _numpy(x, idx, wt, valid, w, slot_of):
    out = np.zeros(x.shape, np.float64)
    for t in np.flatnonzero(valid):
        for e, a in zip(idx[t], wt[t]):
            s = slot_of[e]
            g, u = x[t] @ w.gate[s], x[t] @ w.up[s]
            out[t] += a * ((g / (1 + np.exp(-g)) * u) @ w.down[s])
    return out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the dense path is XLA:CPU's")
def test_dense_matches_grouped_and_numpy():
    x, idx, wt, valid, w = _case()
    E = w.num_experts
    # Logical expert e on physical slot E-1-e: the table is applied, not skipped.
    slots, replicas = jnp.asarray(np.arange(E)[::-1, None].astype(np.int32)), jnp.ones((E,), jnp.int32)
    assert dispatch.dense_on_cpu(w, None)
    y, n = dispatch.local_experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(wt), jnp.asarray(valid), slots,
                                  replicas, w)
    ids = jnp.where(jnp.asarray(valid)[:, None], dispatch.physical_slots(jnp.asarray(idx), slots, replicas, 0), -1)
    yg, _, ng = dispatch._apply_local_experts(jnp.asarray(x), ids, jnp.asarray(wt), w)
    want = _numpy(x, idx, wt, valid, w, np.arange(E)[::-1])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yg), rtol=1e-5, atol=1e-5)
    assert int(n) == int(ng) == int(valid.sum()) * idx.shape[1]
    assert not np.asarray(y)[~valid].any()  # padding rows get nothing


def test_grouped_path_where_dense_does_not_apply():
    _, _, _, _, w = _case()
    many = ExpertWeights(*(jnp.zeros((dispatch.DENSE_CPU_MAX_EXPERTS + 1,) + a.shape[1:]) for a in w[:3]))
    fp8 = w._replace(gate_scale=jnp.ones((16, 1, 1)))
    shared = SharedWeights(jnp.zeros((8, 16)), jnp.zeros((8, 16)), jnp.zeros((16, 8)), 8)
    assert not dispatch.dense_on_cpu(many, None)
    assert not dispatch.dense_on_cpu(fp8, None)
    assert not dispatch.dense_on_cpu(w, shared)
