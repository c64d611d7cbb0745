"""The ``ffi`` MoE backend (ffi/, docs/ffi.md) through its host implementation on 8 CPU devices: the
custom calls against the contract's NumPy statement (FP8 tokens and their scales included, padding,
one-rank routing, a loop), the model equal to ``a2a`` (uniform and one-rank routing, EPLB replicas,
padding rows), and the errors: a missing extension, an unsupported platform, a rank that never comes."""

import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import moejax
from conftest import rel_err
from moejax.eplb.placement import zipf_load
from moejax.parallel import ffi_library, ffi_ops
from test_eplb import _layout as eplb_layout, ckpt  # noqa: F401  (module fixture, rebuilt here)
from test_expert_parallel import _layout, _load, checkpoints  # noqa: F401  (module fixture, rebuilt here)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")
# Skipped only where the install could not have built the extension (no C++ compiler); elsewhere a
# missing library fails these tests with ffi_library's message saying how to build it.
needs_extension = pytest.mark.skipif(
    not ffi_library.available("cpu") and not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="no C++ compiler, so no ffi extension (docs/ffi.md)")

R = 8
AXIS = "ep"


def _contract_dispatch(x, slots, weights, scales, E):
    """The contract (ffi/ep_contract.h) in NumPy, per receiving rank: x etc. are [R, T, ...] per source rank."""
    T, k = slots.shape[1:]
    out = []
    for me in range(R):
        rows = [(s, t) for s in range(R) for t in range(T) if any(0 <= v and v // E == me for v in slots[s, t])]
        here = lambda s, t: (slots[s, t] >= 0) & (slots[s, t] // E == me)  # noqa: E731
        rx = np.zeros((R * T,) + x.shape[2:], x.dtype)
        ids, w = np.full((R * T, k), -1, np.int32), np.zeros((R * T, k), np.float32)
        sc, src = np.zeros((R * T, scales.shape[2]), np.float32), np.full((R * T,), -1, np.int32)
        for i, (s, t) in enumerate(rows):
            rx[i], sc[i], src[i] = x[s, t], scales[s, t], s * T + t
            ids[i] = np.where(here(s, t), slots[s, t] % E, -1)
            w[i] = np.where(here(s, t), weights[s, t], 0)
        counts = np.bincount(ids[ids >= 0], minlength=E)
        out.append(dict(x=rx, ids=ids, weights=w, scales=sc, src=src, expert_counts=counts, num_recv=len(rows)))
    return out


def _run_ops(x, slots, weights, scales, E, loops=1):
    """dispatch then combine (of the received rows times their summed weights) on the 8-device mesh,
    ``loops`` times in a lax.scan (the same custom calls run again within one execution)."""
    mesh = jax.make_mesh((R,), (AXIS,))

    def body(x, slots, weights, scales):
        me = jax.lax.axis_index(AXIS)

        def step(carry, _):
            r = ffi_ops.dispatch(x, slots, weights, me, n_ranks=R, experts_per_rank=E, scales=scales)
            y = r.x.astype(jnp.float32) * r.weights.sum(-1, keepdims=True) + carry
            back = ffi_ops.combine(y.astype(jnp.bfloat16), r.src, me, n_ranks=R)
            return carry + 1.0, (r, back)

        _, (r, back) = jax.lax.scan(step, jnp.zeros((), jnp.float32), length=loops)
        return jax.tree.map(lambda a: a[None], r), back[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    sharded = [jax.device_put(a.reshape((R * a.shape[1],) + a.shape[2:]), NamedSharding(mesh, P(AXIS)))
               for a in (x, slots, weights, scales)]
    r, back = f(*sharded)
    return jax.tree.map(np.asarray, r), np.asarray(back)


@needs_extension
@pytest.mark.parametrize("routing", ["random", "one_rank"])
def test_custom_calls_follow_the_contract_with_fp8_tokens(routing):
    """FP8 e4m3 tokens with their block scales, random slots with padding (-1) and several choices on
    one rank, or every choice on rank 0 (its R*T rows full): each rank's received rows, local ids,
    weights, scales, sources, counts and padding rows equal the contract's NumPy statement, bit for
    bit; the dequantised received rows are their sources'; combine returns, per token, its rows'
    sum over ranks; twice in a loop (the second pass adding 1 to every received row)."""
    rng = np.random.default_rng()
    T, H, k, E, block = 6, 32, 3, 2, 16
    xf = rng.standard_normal((R, T, H)).astype(np.float32)
    scales = np.abs(xf).reshape(R, T, H // block, block).max(-1) / 448.0
    x = (xf / np.repeat(scales, block, -1)).astype(ml_dtypes.float8_e4m3fn)
    if routing == "random":
        slots = rng.integers(-1, R * E, size=(R, T, k)).astype(np.int32)
        slots[:, 0] = -1  # a padding row on every rank
    else:
        slots = np.tile(rng.permuted(np.tile(np.arange(E), 2))[:k], (R, T, 1)).astype(np.int32)
    weights = rng.random((R, T, k)).astype(np.float32)
    got, back = _run_ops(x, slots, weights, scales, E, loops=2)
    want = _contract_dispatch(x, slots, weights, scales, E)
    for me in range(R):
        for name, v in want[me].items():
            g = getattr(got, name)[me, -1]  # the last loop pass
            if name == "x":
                np.testing.assert_array_equal(g.view(np.uint8), v.view(np.uint8), err_msg=f"rank {me} {name}")
            else:
                np.testing.assert_array_equal(g, v, err_msg=f"rank {me} {name}")
        n = want[me]["num_recv"]
        deq = got.x[me, -1, :n].astype(np.float32) * np.repeat(got.scales[me, -1, :n], block, -1)
        src = want[me]["src"][:n]
        np.testing.assert_array_equal(deq, (x.astype(np.float32) * np.repeat(scales, block, -1)).reshape(R * T, H)[src])
    if routing == "one_rank":
        assert want[0]["num_recv"] == R * T and all(w["num_recv"] == 0 for w in want[1:])
    # combine: per token, the bf16-rounded rows (x * summed local weights + pass) of every rank it went to
    xs = x.astype(np.float32)
    for p in range(2):
        want_back = np.zeros((R, T, H), np.float32)
        for me in range(R):
            w = want[me]
            for i in range(w["num_recv"]):
                s, t = divmod(int(w["src"][i]), T)
                row = xs[s, t] * w["weights"][i].sum() + p
                want_back[s, t] += row.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_allclose(back[:, p], want_back, rtol=1e-6, atol=1e-6)


@needs_extension
def test_model_matches_a2a(checkpoints, tmp_path):
    """The ffi backend against a2a on the same 8-device layout: prefill logits (rel 1e-6) with uniform
    and one-rank routing (rank 0 receives every token of every rank: the full worst-case capacity),
    and with uniform routing the greedy tokens and logprobs of 6 decode steps of 5 prompts of
    different lengths (decode batches padded per rank: padding rows)."""
    rng = np.random.default_rng()
    ids = rng.integers(2, 320, size=(8, 11))
    for routing in ("adversarial", "uniform"):
        models = {b: _load(checkpoints[routing], _layout(tmp_path, 8, b)) for b in ("a2a", "ffi")}
        assert rel_err(models["ffi"].score(ids), models["a2a"].score(ids)) < 1e-6, routing
    a2a, ffi = models["a2a"], models["ffi"]  # uniform routing
    prompts = [rng.integers(2, 320, size=int(rng.integers(3, 20))).tolist() for _ in range(5)]
    kw = dict(max_new_tokens=6, ignore_eos=True, logprobs=True)
    for x, y in zip(moejax.generate(a2a, prompts, **kw), moejax.generate(ffi, prompts, **kw)):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(y.logprobs, x.logprobs, rtol=1e-5, atol=1e-6)


@needs_extension
def test_eplb_replicas_and_fused_shared_experts(ckpt, tmp_path):  # noqa: F811
    """With 8 redundant slots and the shared expert fused: the per-rank counts the ffi dispatch
    measures equal the placement's prediction, and after a skewed rebalance (replicas of hot
    experts) the logits equal those before it and a2a's under the same placement."""
    rng = np.random.default_rng()
    ids = rng.integers(2, 320, size=(8, 9))
    models = {b: _load(ckpt, eplb_layout(tmp_path, 8, backend=b), fuse_shared_experts="on") for b in ("a2a", "ffi")}
    m = models["ffi"]
    before = m.score(ids)
    moejax.generate(m, [rng.integers(2, 320, size=5).tolist() for _ in range(6)], max_new_tokens=3, ignore_eos=True)
    bal = m.engine.balancer
    np.testing.assert_array_equal(bal.measured_rank_loads(), bal.predicted_rank_loads())
    assert bal.measured_rank_loads().sum() > 0
    skew = np.tile(zipf_load(32, s=1.2, seed=int(rng.integers(1 << 30)), shuffle=False), (len(bal.names), 1))
    for model in models.values():
        model.engine.balancer.rebalance(skew)
    assert max(p.num_replicas.max() for p in bal.placements.values()) > 1
    after = m.score(ids)
    assert rel_err(after, before) < 1e-6
    assert rel_err(after, models["a2a"].score(ids)) < 1e-6


def test_missing_extension_is_refused_by_name(checkpoints, tmp_path, monkeypatch):
    """Invariant: without the built library (simulated: MOEJAX_FFI_LIBRARY_DIR pointing at an empty
    directory), loading an ffi layout raises a ValueError naming the library and how to build it; an
    a2a layout loads as before; a platform with no implementation is named as such; MoRI in a process
    with several devices is refused saying why."""
    monkeypatch.setenv(ffi_library.LIBRARY_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=r"libmoejax_ep_host\.so, which is not built .*pip install"):
        _load(checkpoints["uniform"], _layout(tmp_path, 8, "ffi"))
    assert not ffi_library.available("cpu")
    _load(checkpoints["uniform"], _layout(tmp_path, 8, "a2a"))
    with pytest.raises(ffi_library.FfiUnavailable, match=r"libmoejax_ep_mori\.so.*hipcc and MoRI"):
        ffi_library.require("rocm")
    with pytest.raises(ffi_library.FfiUnavailable, match="no implementation for platform 'cuda'"):
        ffi_library.require("cuda")
    # MoRI holds one PE per process: a process with 8 devices is refused before MoRI is touched
    with pytest.raises(ffi_library.FfiUnavailable, match="one GPU per process.*this process has 8"):
        ffi_library._check_mori_processes()


@needs_extension
def test_missing_rank_times_out_with_names():
    """Invariant: a call whose peers never arrive (one device told there are 2 ranks) fails after its
    bounded wait with an error naming the ranks that did and did not arrive, instead of hanging."""
    x = jnp.zeros((4, 8), jnp.float32)
    slots = jnp.zeros((4, 2), jnp.int32)
    f = jax.jit(lambda x, s: ffi_ops.dispatch(x, s, jnp.ones((4, 2)), 0, n_ranks=2, experts_per_rank=1,
                                              timeout_s=0.3).num_recv)
    with pytest.raises(Exception, match=r"timed out after 300 ms .*arrived: 0; missing: 1"):
        jax.block_until_ready(f(x, slots))


@needs_extension
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_combine_widens_every_16_bit_value(dtype):
    """combine on one rank (a rendezvous of one) returns every 16-bit pattern of y as its float32 sum
    from +0: float16's subnormals widened exactly (they are float32 normals), infinities kept, -0 as
    +0, and float32 denormals (bfloat16's subnormals) flushed to zero, as XLA:CPU runs custom calls
    with denormals flushed, like its own arithmetic; NaNs stay NaN."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(-1, 256)
    y = bits.view(np.dtype(dtype))
    src = np.arange(y.shape[0], dtype=np.int32)
    got = np.asarray(jax.jit(lambda y, s: ffi_ops.combine(y, s, 0, n_ranks=1))(y, src))
    want = y.astype(np.float32)
    want[np.abs(want) < np.finfo(np.float32).tiny] = 0.0  # denormals and -0 -> +0
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
