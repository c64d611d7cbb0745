"""Memory-bounded prefill attention (layers/prefill_attention.py, pallas_kernels/flash_prefill_attention.py):
the Pallas kernel (interpret mode) and the XLA blocked path against float64 NumPy attention, batched
and packed (prompts back to back in one stream), Triton-IR lowering for CUDA and ROCm, the selection,
chunked prefill over the paged cache and packed prefill against one-shot prefill at the model level
(DeepSeek and Step3), and the compiled XLA path's memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import common, prefill
from moejax.kernels.common import kernel_mode
from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.prefill_attention import paged_prefill_attention, prefill_attention
from pallas_kernels.flash_prefill_attention import flash_packed_prefill_attention, flash_prefill_attention

BF16 = jnp.bfloat16


def reference(q, kv, seq_lens, ctx_lens, kv_start, scale, q_rope=None, k_rope=None, v_offset=None, v_dim=None):
    """float64 NumPy attention, one query and head at a time: query i of sequence b at position
    ctx - n + i sees the keys j of kv (position kv_start + j) with position <= its own and < ctx."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    B, Tq, H, Dk = q.shape
    Tk, Hk = kv.shape[1], kv.shape[2]
    g, vo, Dv = H // Hk, Dk if v_offset is None else v_offset, v_dim or Dk
    out, lse = np.zeros((B, Tq, H, Dv)), np.full((B, Tq, H), -np.inf)
    for b in range(B):
        n, c, k0 = int(seq_lens[b]), int(ctx_lens[b]), int(kv_start[b])
        for i in range(n):
            pos = c - n + i
            ok = (k0 + np.arange(Tk) <= pos) & (k0 + np.arange(Tk) < c)
            if not ok.any():
                continue
            for h in range(H):
                s = kv[b, :, h // g, :Dk] @ q[b, i, h]
                if q_rope is not None:
                    s = s + np.asarray(k_rope[b], np.float64) @ np.asarray(q_rope[b, i, h], np.float64)
                s = s[ok] * scale
                p = np.exp(s - s.max())
                out[b, i, h] = p @ kv[b, ok, h // g, vo:vo + Dv] / p.sum()
                lse[b, i, h] = s.max() + np.log(p.sum())
    return out, lse


# (B, Tq, Tk, H, Hk, Dk, Dv, R, seq_lens, ctx_lens, kv_start, block_q, block_k)
CASES = {
    # MLA expanded: per-head keys, one shared rope key; ragged lengths not dividing the blocks
    "mla": (3, 37, 37, 4, 4, 32, 16, 16, [37, 20, 1], [37, 20, 1], [0, 0, 0], 16, 16),
    # Step3 MFA: 8 query heads on one shared K/V head (rows = tokens x heads), queries the last
    # seq_lens positions of longer contexts (chunked prefill)
    "mfa-offset": (2, 19, 45, 8, 1, 32, 32, 0, [19, 6], [45, 30], [0, 0], 32, 16),
    # MLA chunk against one segment of a longer context (kv_start > 0; some queries see no key)
    "mla-segment": (2, 12, 32, 4, 4, 16, 16, 16, [12, 9], [50, 40], [30, 10], 16, 16),
    # grouped K/V heads (2 groups of 3), value width != key width
    "gqa": (2, 10, 10, 6, 2, 16, 32, 0, [10, 7], [10, 7], [0, 0], 16, 16),
}


def _inputs(rng, B, Tq, Tk, H, Hk, Dk, Dv, R, dtype=np.float32):
    q = rng.standard_normal((B, Tq, H, Dk)).astype(dtype)
    kv = rng.standard_normal((B, Tk, Hk, Dk + Dv)).astype(dtype)
    qr = rng.standard_normal((B, Tq, H, R)).astype(dtype) if R else None
    kr = rng.standard_normal((B, Tk, R)).astype(dtype) if R else None
    return q, kv, qr, kr


def _check(o, lse, ref_o, ref_lse, seq_lens, tol):
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    seen = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == seen).all()  # -inf exactly where a query saw no key (and padding rows)
    np.testing.assert_allclose(o, ref_o, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=tol, rtol=tol)
    for b, n in enumerate(seq_lens):
        assert not o[b, n:].any()  # rows past seq_lens are zeros


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_float64_reference(impl, case):
    """The kernel (interpret mode) and the XLA blocked path against float64 NumPy attention
    (``reference``): output and log-sum-exp, causal by position, ragged lengths."""
    B, Tq, Tk, H, Hk, Dk, Dv, R, lens, ctxs, starts, bq, bk = CASES[case]
    q, kv, qr, kr = _inputs(np.random.default_rng(), B, Tq, Tk, H, Hk, Dk, Dv, R)
    lens, ctxs, starts = (np.asarray(x, np.int32) for x in (lens, ctxs, starts))
    kw = dict(scale=Dk ** -0.5, q_rope=qr, k_rope=kr, v_dim=Dv, block_q=bq, block_k=bk, return_lse=True)
    if impl == "pallas":
        o, lse = flash_prefill_attention(q, kv, lens, ctxs, starts, interpret=True, **kw)
    else:
        o, lse = jax.jit(functools.partial(prefill.xla, **kw))(q, kv, lens, ctxs, starts)
    assert o.shape == (B, Tq, H, Dv) and o.dtype == jnp.float32
    _check(o, lse, *reference(q, kv, lens, ctxs, starts, Dk ** -0.5, qr, kr, v_dim=Dv), lens, 2e-5)


# (T, H, Hk, Dk, Dv, R, prompt lengths, block_q, block_k): T > sum(lengths) leaves padding at the end
PACKED_CASES = {
    # MLA expanded (nope 16 + rope 8 against one shared rope key, v 16): lengths dividing no block
    "mla": (200, 4, 4, 16, 16, 8, [1, 17, 64, 100], 16, 16),
    # Step3 MFA: 8 query heads on one K/V head, [k | v] rows; 32-row tiles are 4 tokens x 8 heads
    "mfa": (190, 8, 1, 16, 16, 0, [100, 1, 17, 64], 32, 16),
    # grouped K/V heads (2 groups of 3), value width != key width, an empty prompt in the batch
    "gqa": (48, 6, 2, 16, 8, 0, [5, 0, 33], 16, 16),
}


def _packed_reference(q, kv, cu, scale, qr, kr, Dv):
    """``reference`` on each prompt of the stream alone (one-shot: its own tokens, positions from 0)."""
    out, lse = np.zeros((q.shape[0], q.shape[1], Dv)), np.full(q.shape[:2], -np.inf)
    for a, e in zip(cu[:-1], cu[1:]):
        if e > a:
            n = np.array([e - a])
            o, l_ = reference(q[None, a:e], kv[None, a:e], n, n, [0], scale, None if qr is None else qr[None, a:e],
                              None if kr is None else kr[None, a:e], v_dim=Dv)
            out[a:e], lse[a:e] = o[0], l_[0]
    return out, lse


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_attention_matches_float64_reference(impl, case):
    """Prompts packed back to back in one stream (cu_seqlens): the kernel (interpret mode) and the
    XLA blocked path against float64 NumPy attention of each prompt alone, output and log-sum-exp
    at every real token; the padding after the last prompt comes back as zeros."""
    T, H, Hk, Dk, Dv, R, lens, bq, bk = PACKED_CASES[case]
    rng = np.random.default_rng()
    q, kv, qr, kr = (None if a is None else a[0] for a in _inputs(rng, 1, T, T, H, Hk, Dk, Dv, R))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kw = dict(scale=Dk ** -0.5, q_rope=qr, k_rope=kr, v_dim=Dv, block_q=bq, block_k=bk, return_lse=True)
    if impl == "pallas":
        o, lse = flash_packed_prefill_attention(q, kv, cu, interpret=True, **kw)
    else:
        o, lse = jax.jit(functools.partial(prefill.xla_packed, **kw))(q, kv, cu)
    assert o.shape == (T, H, Dv) and lse.shape == (T, H) and o.dtype == jnp.float32
    ref_o, ref_lse = _packed_reference(q, kv, cu, Dk ** -0.5, qr, kr, Dv)
    n = cu[-1]
    np.testing.assert_allclose(np.asarray(o)[:n], ref_o[:n], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[:n], ref_lse[:n], atol=2e-5, rtol=2e-5)
    assert not np.asarray(o)[n:].any() and np.isneginf(np.asarray(lse)[n:]).all()


def test_packed_bad_arguments_are_named():
    """Invariant: a packed call with kv of another token count, or cu_seqlens not [B + 1], is refused
    with a ValueError naming the argument."""
    q, kv = jnp.zeros((8, 2, 16)), jnp.zeros((8, 2, 32))
    cu = jnp.array([0, 3, 8], jnp.int32)
    for fn in (flash_packed_prefill_attention, prefill.xla_packed):
        with pytest.raises(ValueError, match="kv"):
            fn(q, kv[:6], cu, scale=0.1)
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(q, kv, cu[None], scale=0.1)


def test_bf16_operands_and_dispatch():
    """bf16 operands (f32 accumulation) through ``prefill_attention`` with "pallas" (interpreter)
    and "xla" forced, against the float64 reference of the bf16-rounded inputs; MLA layout with
    the values after the keys in one row (v_offset)."""
    B, Tq, H, Dk, Dv, R = 2, 24, 4, 32, 16, 16
    q, kv, qr, kr = (None if a is None else jnp.asarray(a, BF16)
                     for a in _inputs(np.random.default_rng(), B, Tq, Tq, H, H, Dk, Dv, R))
    lens = np.array([24, 11], np.int32)
    ref, _ = reference(q.astype(jnp.float32), kv.astype(jnp.float32), lens, lens, [0, 0], 0.2,
                       qr.astype(jnp.float32), kr.astype(jnp.float32), v_dim=Dv)
    for mode in ("pallas", "xla"):
        o = prefill_attention(q, kv, jnp.asarray(lens), scale=0.2, q_rope=qr, k_rope=kr, v_offset=Dk, v_dim=Dv,
                              out_dtype=BF16, mode=mode)
        assert o.dtype == BF16
        np.testing.assert_allclose(np.asarray(o, np.float64), ref, atol=3e-2, rtol=3e-2)


def test_paged_segments_match_reference():
    """``paged_prefill_attention`` over a shuffled block table, several segments merged by
    log-sum-exp, against float64 NumPy attention over the same rows; both paths."""
    rng = np.random.default_rng()
    B, Tq, H, D, bs, nb = 2, 13, 4, 16, 4, 12
    slots_total = (B * nb + 2) * bs
    cache = rng.standard_normal((2, slots_total, 2 * D)).astype(np.float32)  # layer 1 is read
    tables = rng.permutation(slots_total // bs)[:B * nb].reshape(B, nb).astype(np.int32)
    lens, ctxs = np.array([13, 5], np.int32), np.array([41, 22], np.int32)
    q = rng.standard_normal((B, Tq, H, D)).astype(np.float32)
    t = np.arange(nb * bs)
    rows = cache[1][tables[:, t // bs] * bs + t % bs]  # [B, T, 2D]: what the block tables point at
    ref, _ = reference(q, rows[:, :, None], lens, ctxs, [0, 0], 0.25)
    expand = lambda r: (r.reshape(*r.shape[:2], 1, 2 * D), None)  # noqa: E731
    for mode in ("xla", "pallas"):
        o = paged_prefill_attention(jnp.asarray(q), jnp.asarray(cache), tables, lens, ctxs, bs, expand=expand,
                                    scale=0.25, row_dim=2 * D, layer=1, segment=8, mode=mode)
        for b, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(o[b, :n]), ref[b, :n], atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- selection and Triton lowering
def test_selection(monkeypatch):
    """CPU: XLA (blocked, small chunks); a GPU: Pallas for MLA (128 + 64 rope, v 128) and Step3
    (256) shapes, XLA for dims that are not Triton blocks; "pallas" forces the kernel."""
    mla = (1, 2048, 2048, 128, 128, 128, 64, 128, BF16)
    mfa = (1, 2048, 2048, 64, 1, 256, 0, 256, BF16)
    with kernel_mode("auto"):
        c = prefill.plan(*mla)
        assert c.path == "xla" and set(c.params) == {"block_q", "block_k"}
        assert 4 * 128 * c.params["block_q"] * c.params["block_k"] <= 16 << 20  # one chunk's scores
        for gpu in ("cuda", "rocm"):
            monkeypatch.setattr(common, "platform", lambda gpu=gpu: gpu)
            for shape in (mla, mfa):
                c = prefill.plan(*shape)
                assert c.path == "pallas" and c.reason == "gpu" and {"num_warps", "num_stages"} <= set(c.params)
                assert (c.params["num_stages"] == 1) if gpu == "rocm" else (c.params["num_stages"] >= 2)
            assert prefill.plan(1, 2048, 2048, 16, 16, 96, 32, 128, BF16).path == "xla"  # 96: no Triton block
            assert prefill.plan(1, 5, 5, 4, 4, 128, 64, 128, BF16).params["block_q"] == 16  # tiny prompt
        monkeypatch.undo()
    with kernel_mode("pallas"):
        assert prefill.plan(1, 33, 33, 4, 4, 24, 8, 16, jnp.float32).path == "pallas"  # interpreter: any dims
    with kernel_mode("xla"):
        assert prefill.plan(*mla).path == "xla"


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernel_lowers_to_triton(platform, monkeypatch):
    """Pallas -> Triton IR at DeepSeek-V3 MLA (128 heads, 128 + 64 rope, v 128) and Step3 MFA
    (64 heads over one 256-dim K/V head) prefill shapes with the selected GPU block sizes, batched
    and packed (IR only: not compiled to PTX / HSACO, no GPU here)."""
    S = jax.ShapeDtypeStruct
    monkeypatch.setattr(common, "platform", lambda: platform)
    i32 = S((2,), jnp.int32)
    for Tq, Tk in ((1000, 1000), (300, 2000)):  # one-shot (lengths not dividing the blocks), and a chunk
        p = prefill.plan(2, Tq, Tk, 128, 128, 128, 64, 128, BF16).params
        f = functools.partial(flash_prefill_attention, scale=0.1, v_offset=128, v_dim=128, out_dtype=BF16,
                              interpret=False, **p)
        text = jax.jit(lambda q, kv, qr, kr, a, b, c: f(q, kv, a, b, c, q_rope=qr, k_rope=kr)).trace(
            S((2, Tq, 128, 128), BF16), S((2, Tk, 128, 256), BF16), S((2, Tq, 128, 64), BF16), S((2, Tk, 64), BF16),
            i32, i32, i32).lower(lowering_platforms=(platform,)).as_text()
        assert text.count("xla.gpu.triton") == 1
        p = prefill.plan(2, Tq, Tk, 64, 1, 256, 0, 256, BF16).params
        f = functools.partial(flash_prefill_attention, scale=0.1, return_lse=True, interpret=False, **p)
        text = jax.jit(f).trace(S((2, Tq, 64, 256), BF16), S((2, Tk, 1, 512), BF16), i32, i32, i32).lower(
            lowering_platforms=(platform,)).as_text()
        assert text.count("xla.gpu.triton") == 1
    # packed: 3 prompts in a stream of 3000 tokens (a multiple of neither tile)
    T, cu = 3000, S((4,), jnp.int32)
    p = prefill.plan(1, T, T, 128, 128, 128, 64, 128, BF16).params
    f = functools.partial(flash_packed_prefill_attention, scale=0.1, v_offset=128, v_dim=128, out_dtype=BF16,
                          interpret=False, **p)
    text = jax.jit(lambda q, kv, qr, kr, c: f(q, kv, c, q_rope=qr, k_rope=kr)).trace(
        S((T, 128, 128), BF16), S((T, 128, 256), BF16), S((T, 128, 64), BF16), S((T, 64), BF16), cu).lower(
        lowering_platforms=(platform,)).as_text()
    assert text.count("xla.gpu.triton") == 1
    p = prefill.plan(1, T, T, 64, 1, 256, 0, 256, BF16).params
    f = functools.partial(flash_packed_prefill_attention, scale=0.1, return_lse=True, interpret=False, **p)
    text = jax.jit(f).trace(S((T, 64, 256), BF16), S((T, 1, 512), BF16), cu).lower(
        lowering_platforms=(platform,)).as_text()
    assert text.count("xla.gpu.triton") == 1


# ---------------------------------------------------------------- the model: chunked vs one-shot
BS, NB, S, CHUNK = 16, 4, 48, 32  # KV block, blocks per sequence, one-shot length, padded chunk length
LENS = np.array([45, 37])
CUTS = [[0, 13, 30, 45], [0, 7, 33, 37]]  # 13 / 7: inside block 0; 30 and 33: across into blocks 1 and 2


@functools.lru_cache(maxsize=None)
def _tiny(name):
    """The tiny model and its one-shot prefill (XLA), compiled once per model for every case."""
    from moejax.models.registry import build_module, parse_model_config
    from moejax.tiny.presets import preset
    cfg = parse_model_config(preset(name))
    module = build_module(cfg, "float32")
    routing = module.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["routing"]

    @jax.jit
    def one_shot(v, cache, tokens, slots):
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (len(LENS), S))
        with kernel_mode("xla"):
            h, cache = module.apply(v, tokens, ForwardBatch.prefill(pos, jnp.asarray(LENS, jnp.int32), slots), cache,
                                     method="prefill")
        return module.apply(v, h, method="logits"), cache

    return cfg, module, routing, one_shot


@pytest.mark.parametrize("name,mode,segment", [
    ("v3-tiny", "xla", None), ("v3-tiny", "xla", 16), ("v3-tiny", "pallas", 16),
    ("step3-tiny", "xla", None), ("step3-tiny", "pallas", 16),
])
def test_chunked_prefill_matches_one_shot(name, mode, segment, monkeypatch):
    """Prefilling two prompts in three chunks through the paged-cache path (chunk boundaries at odd
    positions, inside and across 16-token KV blocks; ``segment`` 16: the cache read in 16-token
    segments merged by log-sum-exp) gives the logits of one-shot prefill (float32, 1e-5) at every
    position, and the same cache."""
    from moejax.tiny.checkpoint import random_params
    if segment:
        monkeypatch.setattr(prefill, "segment", lambda *a: segment)
    cfg, module, routing, one_shot = _tiny(name)
    rng = np.random.default_rng()
    v = {"params": random_params(cfg, int(rng.integers(2 ** 31)), std=0.1), "routing": routing}
    B = len(LENS)
    num_slots = (B * NB + 1) * BS
    tables = rng.permutation(num_slots // BS)[:B * NB].reshape(B, NB).astype(np.int32)  # shuffled pages
    tokens = rng.integers(2, cfg.vocab_size, (B, S)).astype(np.int32)
    slot_of = lambda b, p: tables[b, p // BS] * BS + p % BS  # noqa: E731
    cache0 = jnp.zeros((cfg.num_hidden_layers, num_slots, cfg.kv_cache_dim), jnp.float32)
    slots = np.full((B, S), num_slots, np.int32)  # padding rows: out of range, dropped
    for b, n in enumerate(LENS):
        slots[b, :n] = slot_of(b, np.arange(n))
    want, want_cache = one_shot(v, cache0, tokens, slots)

    @jax.jit
    def chunk(v, cache, toks, pos, n, ctx, slots):
        h, cache = module.apply(v, toks, ForwardBatch.prefill(pos, n, slots, tables, ctx, BS), cache, method="prefill")
        return module.apply(v, h, method="logits"), cache

    got, cache = np.zeros(want.shape, np.float32), cache0
    with kernel_mode(mode):
        for c in range(3):
            starts = np.array([CUTS[b][c] for b in range(B)])
            n = np.array([CUTS[b][c + 1] for b in range(B)]) - starts
            pos, toks = np.zeros((B, CHUNK), np.int32), np.zeros((B, CHUNK), np.int32)
            cslots = np.full((B, CHUNK), num_slots, np.int32)
            for b in range(B):
                p = starts[b] + np.arange(n[b])
                pos[b, :n[b]], toks[b, :n[b]], cslots[b, :n[b]] = p, tokens[b, p], slot_of(b, p)
            lg, cache = chunk(v, cache, toks, pos, n.astype(np.int32), (starts + n).astype(np.int32), cslots)
            for b in range(B):
                got[b, starts[b]:starts[b] + n[b]] = np.asarray(lg[b, :n[b]])
    for b, n in enumerate(LENS):
        np.testing.assert_allclose(got[b, :n], np.asarray(want[b, :n]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cache), np.asarray(want_cache), atol=1e-5)


@pytest.mark.parametrize("name,mode", [("v3-tiny", "xla"), ("v3-tiny", "pallas"), ("step3-tiny", "xla"),
                                       ("step3-tiny", "pallas")])
def test_packed_prefill_matches_batched(name, mode):
    """The two prompts of the one-shot test packed in one 96-token stream (cu_seqlens, padding after
    them written to an out-of-range slot) give the batched one-shot logits (float32, 1e-5) at every
    real token, and the same cache."""
    from moejax.tiny.checkpoint import random_params
    cfg, module, routing, one_shot = _tiny(name)
    rng = np.random.default_rng()
    v = {"params": random_params(cfg, int(rng.integers(2 ** 31)), std=0.1), "routing": routing}
    B, T = len(LENS), 96
    num_slots = B * NB * BS
    slot_of = rng.permutation(num_slots).reshape(B, NB * BS).astype(np.int32)  # any slot of any page
    tokens = rng.integers(2, cfg.vocab_size, (B, S)).astype(np.int32)
    slots = np.full((B, S), num_slots, np.int32)
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    p_tokens, p_pos, p_slots = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, num_slots, np.int32)
    for b, n in enumerate(LENS):
        slots[b, :n] = slot_of[b, :n]
        p_tokens[cu[b]:cu[b + 1]], p_pos[cu[b]:cu[b + 1]], p_slots[cu[b]:cu[b + 1]] = tokens[b, :n], np.arange(n), \
            slot_of[b, :n]
    cache0 = jnp.zeros((cfg.num_hidden_layers, num_slots, cfg.kv_cache_dim), jnp.float32)
    want, want_cache = one_shot(v, cache0, tokens, slots)

    @jax.jit
    def packed(v, cache, toks, pos, cu, slots):
        with kernel_mode(mode):
            h, cache = module.apply(v, toks, ForwardBatch.prefill(pos, slots=slots, cu_seqlens=cu), cache,
                                     method="prefill")
        return module.apply(v, h, method="logits"), cache

    got, cache = packed(v, cache0, p_tokens, p_pos, cu, p_slots)
    assert got.shape == (T, cfg.vocab_size)
    for b, n in enumerate(LENS):
        np.testing.assert_allclose(np.asarray(got[cu[b]:cu[b + 1]]), np.asarray(want[b, :n]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cache), np.asarray(want_cache), atol=1e-5)


# ---------------------------------------------------------------- memory
def test_xla_prefill_memory_is_bounded():
    """The compiled XLA prefill of one MLA layer (16 heads, S = 4096, float32) against what the
    [heads, S, S] float32 scores alone need (1 GiB): XLA's memory analysis of its temporaries stays
    below 1/8 of that (the full-score form needs more than the scores)."""
    from moejax.layers.mla import MLA
    from moejax.models.registry import parse_model_config
    from moejax.tiny.presets import preset
    cfg = parse_model_config(preset("v3-tiny", num_attention_heads=16, num_key_value_heads=16))
    S, H = 4096, cfg.num_attention_heads
    mla = MLA(cfg, 0)
    x = jax.ShapeDtypeStruct((1, S, cfg.hidden_size), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, S), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    params = jax.eval_shape(lambda: mla.init(jax.random.key(0), jnp.zeros((1, 4, cfg.hidden_size)),
                                             ForwardBatch.prefill(jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 4)),
                                             method="prefill"))
    with kernel_mode("xla"):
        fn = jax.jit(lambda p, x, pos, n: mla.apply(p, x, ForwardBatch.prefill(pos, n), method="prefill")[0])
        temp = fn.lower(params, x, pos, lens).compile().memory_analysis().temp_size_in_bytes
    scores = 4 * H * S * S
    print(f"XLA prefill temporaries {temp / 2**20:.1f} MiB; [heads, S, S] f32 scores {scores / 2**20:.0f} MiB")
    assert temp < scores / 8
