"""Horizontal fusion of the MoE block (issue 18): shared experts computed inside the routed-expert
kernel as always-selected extra experts of weight 1, against the kernel's NumPy reference and
against the unfused model (float32 within 1e-5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import prefill_then_decode_logits, rel_err

import moejax
from moejax.kernels import moe
from moejax.kernels.common import kernel_mode, shared_expert_fusion
from moejax.layers.experts import ExpertWeights, SharedWeights, grouped_expert_mlp
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from pallas_kernels.fused_moe import fused_moe

BF16 = jnp.bfloat16


def _swiglu(x, wg, wu, wd):
    a, b = x @ wg, x @ wu
    return (a / (1 + np.exp(-a)) * b) @ wd


def fused_reference(x, group_sizes, wg, wu, wd, sg, su, sd):
    """float32 NumPy: routed groups through their expert ([E, in, out]), then S shared groups through
    shared expert s = columns s*I..(s+1)*I of the HF [out, in] matrices."""
    x, wg, wu, wd, sg, su, sd = (np.asarray(a, np.float32) for a in (x, wg, wu, wd, sg, su, sd))
    E, _, I = wg.shape
    out, start = np.zeros((x.shape[0], wd.shape[-1]), np.float32), 0
    for e, g in enumerate(np.asarray(group_sizes)):
        xe = x[start:start + g]
        if e < E:
            out[start:start + g] = _swiglu(xe, wg[e], wu[e], wd[e])
        else:
            c = slice((e - E) * I, (e - E + 1) * I)
            out[start:start + g] = _swiglu(xe, sg[c].T, su[c].T, sd[:, c].T)
        start += g
    return out


def _inputs(rng, N, H, I, E, S, dtype):
    n = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    x = n(N, H)
    routed = [n(E, H, I) / H ** 0.5, n(E, H, I) / H ** 0.5, n(E, I, H) / I ** 0.5]
    shared = [n(S * I, H) / H ** 0.5, n(S * I, H) / H ** 0.5, n(H, S * I) / (S * I) ** 0.5]
    return (jnp.asarray(x, dtype), *(jnp.asarray(a, dtype) for a in routed + shared))


@pytest.mark.parametrize("N,H,I,group_sizes,S,blocks", [
    (29, 40, 24, [3, 0, 7, 2, 6, 6], 2, (16, 16, 16)),  # odd H and I, an empty expert, 2 shared, 5 garbage rows
    (5, 48, 40, [0, 1, 0, 3], 1, (16, 16, 32)),         # decode-like: one routed token, one shared group
    (40, 32, 32, [8, 0, 12, 20], 1, (16, 32, 32)),      # all aligned (slice fast path), empty routed expert
])
def test_fused_moe_with_shared_experts_matches_reference(N, H, I, group_sizes, S, blocks):
    """fused_moe with shared experts (HF layout) in the Pallas interpreter against float32 NumPy on the
    same bf16 inputs: rel 1e-2 on the grouped rows; rows past the groups exactly zero."""
    x, wg, wu, wd, sg, su, sd = _inputs(np.random.default_rng(), N, H, I, len(group_sizes) - S, S, BF16)
    gs = jnp.asarray(group_sizes, jnp.int32)
    bm, bn, bk = blocks
    y = fused_moe(x, gs, wg, wu, wd, sg, su, sd, block_m=bm, block_n=bn, block_k=bk, block_n_down=bn,
                  block_k_down=bk, interpret=True)
    n = int(sum(group_sizes))
    assert y.shape == (N, H) and y.dtype == jnp.float32
    assert rel_err(y[:n], fused_reference(x, gs, wg, wu, wd, sg, su, sd)[:n]) < 1e-2
    assert not np.any(np.asarray(y[n:]))


def test_fused_moe_checks_shared_shapes():
    x, wg, wu, wd, sg, su, sd = _inputs(np.random.default_rng(), 8, 32, 16, 2, 1, jnp.float32)
    gs = jnp.asarray([2, 3, 3], jnp.int32)
    with pytest.raises(ValueError, match="shared_down"):
        fused_moe(x, gs, wg, wu, wd, sg, su, sd.T, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        fused_moe(x, gs[:2], wg, wu, wd, sg, su, sd, interpret=True)


def test_grouped_expert_mlp_xla_and_pallas_agree_with_shared():
    """The model's grouped_expert_mlp with shared experts: the XLA form (ragged_dot over the routed stack
    and over [zeros, shared]) and the Pallas kernel against the NumPy reference, float32 within 1e-5."""
    x, wg, wu, wd, sg, su, sd = _inputs(np.random.default_rng(), 21, 24, 16, 3, 2, jnp.float32)
    gs = jnp.asarray([4, 0, 5, 6, 3], jnp.int32)  # 3 garbage rows after the shared groups
    want = fused_reference(x, gs, wg, wu, wd, sg, su, sd)[:18]
    w, s = ExpertWeights(wg, wu, wd), SharedWeights(sg, su, sd, 16)
    for mode in ("xla", "pallas"):
        with kernel_mode(mode):
            y = grouped_expert_mlp(x, gs, w, s)
        np.testing.assert_allclose(np.asarray(y[:18]), want, rtol=1e-5, atol=1e-5)


def test_fused_kernel_lowers_to_triton():
    """With shared experts the two kernels still lower to Triton IR (DeepSeek-V3 decode shapes, one
    shared expert; odd sizes with two): IR only, no GPU here."""
    S_ = jax.ShapeDtypeStruct
    for E, H, I, S, N, p in ((32, 7168, 2048, 1, 320, None), (4, 40, 24, 2, 13, {})):
        if p is None:
            with kernel_mode("pallas"):
                p = moe.plan(N, E + S, H, I, BF16).params
        f = functools.partial(fused_moe, **p, interpret=False)
        text = jax.jit(f).trace(S_((N, H), BF16), S_((E + S,), jnp.int32), S_((E, H, I), BF16), S_((E, H, I), BF16),
                                S_((E, I, H), BF16), S_((S * I, H), BF16), S_((S * I, H), BF16),
                                S_((H, S * I), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 2


# ------------------------------------------------------------------ the model, fused vs unfused
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random float32 checkpoints: V3 (1 shared expert), V2-Lite (2) and Step3 (its share_expert
    of twice the routed width: two extra experts)."""
    out = {}
    for name, cfg in (("v3-tiny", preset("v3-tiny")), ("v2-lite-tiny", preset("v2-lite-tiny")),
                      ("step3-tiny", preset("step3-tiny", share_expert_dim=64))):
        out[name] = make_random_checkpoint(str(tmp_path_factory.mktemp(name)), cfg, seed=5, std=0.1)
    return out


def prefill_then_decode(path, kernels="auto", fuse="auto"):
    """Logits of every prompt token (prefill) and of one decode step, three sequences of float32."""
    bs, nb = 8, 4
    m = moejax.load(path, dtype="float32", max_model_len=64, max_num_seqs=4, block_size=bs, num_kv_blocks=16,
                    progress=False, kernels=kernels, fuse_shared_experts=fuse)
    cfg = m.config.model
    cache = jnp.zeros((cfg.num_hidden_layers, 16 * bs, cfg.kv_cache_dim), jnp.float32)
    lens, S = np.array([3, 9, 14]), 16
    pre, dec = prefill_then_decode_logits(m, cache, lens, S, bs, nb)  # the same tokens for every setting
    real = np.arange(S)[None, :] < lens[:, None]
    return np.asarray(pre)[real], np.asarray(dec)


@pytest.mark.parametrize("name", ["v3-tiny", "v2-lite-tiny", "step3-tiny"])
def test_model_fused_shared_experts_match_unfused(checkpoints, name):
    """Prefill and decode logits with the shared experts inside the routed-expert computation (XLA form)
    against the separate shared MLP: float32 within 1e-5."""
    pre_u, dec_u = prefill_then_decode(checkpoints[name], fuse="off")
    pre_f, dec_f = prefill_then_decode(checkpoints[name], fuse="on")
    np.testing.assert_allclose(pre_f, pre_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dec_f, dec_u, rtol=1e-5, atol=1e-5)


def test_model_fused_kernel_matches_unfused_xla(checkpoints):
    """V2-Lite (two shared experts) with the Pallas kernel (interpreter) taking the shared experts,
    against the unfused XLA model: float32 within 1e-5."""
    pre_u, dec_u = prefill_then_decode(checkpoints["v2-lite-tiny"], kernels="xla", fuse="off")
    pre_f, dec_f = prefill_then_decode(checkpoints["v2-lite-tiny"], kernels="pallas", fuse="auto")
    np.testing.assert_allclose(pre_f, pre_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dec_f, dec_u, rtol=1e-5, atol=1e-5)


def test_fusion_switch_and_defaults():
    """"auto" fuses exactly where the Pallas fused MoE runs; a bad setting names the argument."""
    with shared_expert_fusion("auto"):
        with kernel_mode("xla"):
            assert not moe.fuse_shared_experts(16, 64, 32, jnp.float32)
        with kernel_mode("pallas"):
            assert moe.fuse_shared_experts(16, 64, 32, jnp.float32)
    with shared_expert_fusion("off"), kernel_mode("pallas"):
        assert not moe.fuse_shared_experts(16, 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="shared_expert_fusion"), shared_expert_fusion("yes"):
        pass
