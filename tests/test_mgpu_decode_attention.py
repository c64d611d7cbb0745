"""The Mosaic GPU MLA decode kernel (pallas_kernels/mgpu_decode_attention.py) against float64 NumPy attention
over what the cache holds: on CPU in Mosaic GPU's interpreter (its TMA copies, barriers and the two
compute warpgroups' exchange simulated; the products there are jnp.dot of the same tiles: the
interpreter takes no transposed or register wgmma operands), on a Hopper GPU compiled (``pytest
tests/test_mgpu_decode_attention.py`` on the device machine, DeepSeek-V3's shapes).

Seeds from the per-test seed (conftest; MOEJAX_TEST_SEED replays a failure)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mgpu_decode_attention import fp8_row_dim, mgpu_mfa_decode, mgpu_mla_decode, smem_bytes
from test_kernels import BF16, fresh_key_seed, mfa_reference, mla_inputs, mla_reference, rel_err, stored_cache

ON_HOPPER = jax.default_backend() == "gpu" and "H100" in jax.devices()[0].device_kind or \
    jax.default_backend() == "gpu" and "H200" in jax.devices()[0].device_kind


def _check(kv, B, H, C, R, block_size, nb, lens, block_t, stages, splits, interpret, rows=1):
    """``rows`` > 1: ``lens`` [B, rows] (each query row its own length), the kernel's grouped form
    (q [B, rows, H, *]) against the reference over every row with its sequence's block table."""
    values, ql, qr, bt = mla_inputs(fresh_key_seed(), B * rows, H, C, R, block_size, nb)
    bt = bt[:B]
    lens = jnp.asarray(lens, jnp.int32).reshape(B * rows)
    scale = 1.2 / (C + R) ** 0.5
    cache, stored = stored_cache(values, kv, C + R)
    if kv == "fp8" and not interpret:  # the compiled kernel's rows: kv_quant's, zero-padded to 128-byte tiles
        cache = jnp.pad(cache, ((0, 0), (0, 0), (0, fp8_row_dim(C + R) - cache.shape[-1])))
    exact = mla_reference(ql, qr, stored, jnp.repeat(bt, rows, axis=0), lens, block_size, scale)
    kw = dict(block_size=block_size, scale=scale, layer=1, block_t=block_t, num_stages=stages, num_splits=splits,
              interpret=interpret)
    args = (ql, qr, cache, bt, lens)
    if rows > 1:
        args = (ql.reshape(B, rows, H, C), qr.reshape(B, rows, H, R), cache, bt, lens.reshape(B, rows))
    shape = (B, H, C) if rows == 1 else (B, rows, H, C)
    got = mgpu_mla_decode(*args, **kw)
    assert got.shape == shape and got.dtype == jnp.float32
    got = got.reshape(B * rows, H, C)
    assert rel_err(got, exact) < 1e-2
    for b in range(B * rows):  # every query row right, not only the whole on average
        assert rel_err(got[b], exact[b]) < 1e-2, b
    gb = mgpu_mla_decode(*args, out_dtype=BF16, **kw)
    assert gb.dtype == BF16 and rel_err(gb.reshape(B * rows, H, C), exact) < 1e-2


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter run (CPU); the GPU runs the compiled test")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("lens,block_t,splits", [
    ([1, 37], 64, 1),    # one token; a ragged last tile; the bf16 result staged in the query's buffer
    ([128, 21], 64, 3),  # 3 splits (one empty for the short sequence), float32 partials
])
def test_interpreter_matches_reference(kv, lens, block_t, splits):
    _check(kv, B=2, H=64, C=128, R=64, block_size=16, nb=8, lens=lens, block_t=block_t, stages=2, splits=splits,
           interpret=True)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter run (CPU); the GPU runs the compiled test")
@pytest.mark.parametrize("kv,rows,heads,lens,splits", [
    ("bf16", 2, 32, [[36, 37], [1, 2]], 1),   # 32 heads a CTA; a row of one token
    ("fp8", 2, 32, [[36, 37], [1, 2]], 1),
    ("fp8", 3, 16, [[63, 64, 65], [19, 20, 21]], 2),  # 16 heads, 48 of the 64 wgmma rows; ends on a tile / split
    ("bf16", 4, 16, [[61, 62, 63, 64], [5, 6, 7, 8]], 1),  # 16 heads, the 64 rows
])
def test_interpreter_rows_together(kv, rows, heads, lens, splits):
    """The speculative verify's rows a sequence in one CTA (the context read once): causal among them (one
    CTA a sequence and split here, to keep the interpreter's run short)."""
    _check(kv, B=2, H=heads, C=128, R=64, block_size=16, nb=8, lens=lens, block_t=64, stages=2, splits=splits,
           interpret=True, rows=rows)


@pytest.mark.skipif(not ON_HOPPER, reason="compiled for sm_90 (an H100 or H200)")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("B,H,nb,lens,block_t,stages,splits", [
    (3, 128, 40, [1, 333, 640], 64, 2, 1),
    (2, 128, 64, [1024, 77], 64, 2, 4),
    (4, 64, 16, [256, 16, 17, 255], 64, 2, 2),
])
def test_device_matches_reference(kv, B, H, nb, lens, block_t, stages, splits):
    _check(kv, B=B, H=H, C=512, R=64, block_size=16, nb=nb, lens=lens, block_t=block_t, stages=stages, splits=splits,
           interpret=False)


@pytest.mark.skipif(not ON_HOPPER, reason="compiled for sm_90 (an H100 or H200)")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("rows,lens,splits", [
    (2, [[332, 333], [1, 2]], 1),
    (3, [[1022, 1023, 1024], [75, 76, 77]], 4),
    (4, [[61, 62, 63, 64], [637, 638, 639, 640]], 2),
])
def test_device_rows_together(kv, rows, lens, splits):
    _check(kv, B=2, H=128, C=512, R=64, block_size=16, nb=64, lens=lens, block_t=64, stages=2, splits=splits,
           interpret=False, rows=rows)


def test_bad_arguments_name_the_field():
    q, qr = jnp.ones((1, 64, 128), BF16), jnp.ones((1, 64, 64), BF16)
    assert fp8_row_dim(576) == 640 and fp8_row_dim(192) == 256
    cache = jnp.ones((2, 32, 192), BF16)
    bt, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    kw = dict(block_size=16, scale=0.1, layer=0, interpret=True)
    with pytest.raises(ValueError, match="heads"):
        mgpu_mla_decode(q[:, :16], qr[:, :16], cache, bt, lens, **kw)
    with pytest.raises(ValueError, match="block_t"):
        mgpu_mla_decode(q, qr, cache, bt, lens, **dict(kw, block_t=32))
    with pytest.raises(ValueError, match="cache dtype"):
        mgpu_mla_decode(q, qr, cache.astype(jnp.float16), bt, lens, **kw)
    with pytest.raises(ValueError, match="scale byte"):  # FP8 rows without room for the scale's box
        mgpu_mla_decode(q, qr, cache.astype(jnp.float8_e4m3fn), bt, lens, **kw)
    with pytest.raises(ValueError, match="multiple of 128 bytes"):  # kv_quant's 592-byte rows, compiled
        mgpu_mla_decode(q, qr, jnp.ones((1, 32, 576 + 16), jnp.float8_e4m3fn), bt, lens,
                        **dict(kw, interpret=False))
    with pytest.raises(ValueError, match="layer"):
        mgpu_mla_decode(q, qr, cache, bt, lens, **dict(kw, layer=2))
    with pytest.raises(ValueError, match="q_rope"):
        mgpu_mla_decode(q, qr[:, :32], cache, bt, lens, **kw)
    with pytest.raises(ValueError, match="rows"):  # 1 to 4 query rows a sequence
        mgpu_mla_decode(jnp.ones((1, 5, 64, 128), BF16), jnp.ones((1, 5, 64, 64), BF16), cache, bt,
                        jnp.ones((1, 5), jnp.int32), **kw)
    with pytest.raises(ValueError, match="seq_lens"):  # the rows' lengths [B, Q]
        mgpu_mla_decode(q[:, None], qr[:, None], cache, bt, lens, **kw)
    with pytest.raises(ValueError, match="heads"):  # 2 rows: CTAs of 32 heads
        mgpu_mla_decode(jnp.ones((1, 2, 16, 128), BF16), jnp.ones((1, 2, 16, 64), BF16), cache, bt,
                        jnp.ones((1, 2), jnp.int32), **kw)


def test_shared_memory_fits_hopper():
    """The tilings the selection may take fit a CTA's 227 KB (the compiler refuses more)."""
    assert smem_bytes(512, 64, 64, 2) <= 227 * 1024
    assert smem_bytes(512, 64, 64, 3) > 227 * 1024  # why a third slot is not offered
    assert smem_bytes(512, 64, 64, 1, fp8=True) <= 227 * 1024


@pytest.mark.parametrize("kv,splits", [("bf16", 1), ("fp8", 2)])
def test_lowers_for_cuda_at_deepseek_shapes(kv, splits, monkeypatch):
    """Mosaic GPU's lowering (its shared-memory budget, TMA box and layout rules) at DeepSeek-V3's shapes, on
    this machine: lowered for CUDA, not compiled or run (the device test does that)."""
    import functools

    import pallas_kernels.mgpu_decode_attention as m
    monkeypatch.setattr(m, "platform", lambda: "cuda")
    B, H, C, R, bs, nb = 2, 128, 512, 64, 16, 8
    cache = jax.ShapeDtypeStruct((1, B * nb * bs, 576 if kv == "bf16" else fp8_row_dim(C + R)),
                                 BF16 if kv == "bf16" else jnp.float8_e4m3fn)
    args = (jax.ShapeDtypeStruct((B, H, C), BF16), jax.ShapeDtypeStruct((B, H, R), BF16), cache,
            jax.ShapeDtypeStruct((B, nb), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    f = jax.jit(functools.partial(mgpu_mla_decode, block_size=bs, scale=0.1, layer=0, out_dtype=BF16,
                                  num_splits=splits, interpret=False))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter run (CPU)")
def test_selected_through_mla_decode_run_with_verify_rows(monkeypatch):
    """mla_decode.run with the kernel chosen (mla_kernel=mgpu) takes the speculative verify's rows a sequence
    (each row its own length) together (the context read once) and equals the XLA path over each row with
    the sequence's block table (float64 reference bounds as above)."""
    from moejax.kernels import common, mla_decode
    monkeypatch.setenv(common.MLA_KERNEL_ENV, "mgpu")
    B, Q, H, C, R, bs, nb = 2, 2, 64, 128, 64, 16, 8
    values, ql, qr, bt = mla_inputs(fresh_key_seed(), B * Q, H, C, R, bs, nb)
    bt = bt[:B]
    lens = jnp.asarray([[40, 41], [99, 100]], jnp.int32).reshape(-1)
    cache, stored = stored_cache(values, "bf16", C + R)
    scale = 1.2 / (C + R) ** 0.5
    assert mla_decode.plan(B * Q, H, C, R, nb * bs, bs, cache.dtype, "pallas").path == "mgpu"
    assert mla_decode.plan(B, H, C, R, nb * bs, bs, cache.dtype, "pallas", rows=Q).params["rows"] == Q
    with common.kernel_mode("pallas"):
        got = mla_decode.run(ql, qr, cache, bt, lens, bs, scale, layer=1, rows=Q)
    exact = mla_reference(ql, qr, stored, jnp.repeat(bt, Q, axis=0), lens, bs, scale)
    xla = mla_decode.xla(ql, qr, cache, jnp.repeat(bt, Q, axis=0), lens, bs, scale, layer=1)
    assert got.shape == (B * Q, H, C)
    assert rel_err(got, exact) < 1e-2 and rel_err(got, xla) < 1e-2


def _check_mfa(B, H, D, block_size, nb, lens, splits, interpret):
    """Step3's MFA rows [k | v] (one K/V head) through the Mosaic GPU kernel against float64 attention."""
    k = jax.random.split(jax.random.key(fresh_key_seed()), 3)
    num_slots = B * nb * block_size + block_size
    values = jax.random.normal(k[0], (2, num_slots, 2 * D))
    q = jax.random.normal(k[1], (B, H, D)).astype(BF16)
    bt = jax.random.permutation(k[2], num_slots // block_size)[:B * nb].reshape(B, nb).astype(jnp.int32)
    lens = jnp.asarray(lens, jnp.int32)
    cache = values.astype(BF16)
    scale = D ** -0.5
    exact = mfa_reference(q, cache[1].astype(jnp.float32), bt, lens, block_size, scale)
    kw = dict(block_size=block_size, scale=scale, layer=1, num_splits=splits, interpret=interpret)
    got = mgpu_mfa_decode(q, cache, bt, lens, **kw)
    assert got.shape == (B, H, D) and got.dtype == jnp.float32
    for b in range(B):
        assert rel_err(got[b], exact[b]) < 1e-2, b
    gb = mgpu_mfa_decode(q, cache, bt, lens, out_dtype=BF16, **kw)
    assert gb.dtype == BF16 and rel_err(gb, exact) < 1e-2


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter run (CPU); the GPU runs the compiled test")
@pytest.mark.parametrize("lens,splits", [([1, 70], 1), ([128, 9], 2)])
def test_interpreter_mfa_matches_reference(lens, splits):
    _check_mfa(B=2, H=64, D=128, block_size=16, nb=8, lens=lens, splits=splits, interpret=True)


@pytest.mark.skipif(not ON_HOPPER, reason="compiled for sm_90 (an H100 or H200)")
@pytest.mark.parametrize("B,nb,lens,splits", [(3, 40, [1, 333, 640], 1), (2, 64, [1024, 77], 4)])
def test_device_mfa_matches_reference(B, nb, lens, splits):
    _check_mfa(B=B, H=64, D=256, block_size=16, nb=nb, lens=lens, splits=splits, interpret=False)


def test_mfa_bad_arguments_and_lowering(monkeypatch):
    """The MFA entry's refusals, and Mosaic GPU's lowering at Step3's shapes (64 heads x 256, rows [k | v])."""
    import functools

    import pallas_kernels.mgpu_decode_attention as m
    q, bt, lens = jnp.ones((1, 64, 256), BF16), jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    kw = dict(block_size=16, scale=0.1, layer=0, interpret=True)
    with pytest.raises(ValueError, match="cache dtype"):
        mgpu_mfa_decode(q, jnp.ones((1, 32, 512), jnp.float8_e4m3fn), bt, lens, **kw)
    with pytest.raises(ValueError, match=r"\[k \| v\]"):
        mgpu_mfa_decode(q, jnp.ones((1, 32, 576), BF16), bt, lens, **kw)
    with pytest.raises(ValueError, match="heads"):
        mgpu_mfa_decode(q[:, :48], jnp.ones((1, 32, 512), BF16), bt, lens, **kw)
    with pytest.raises(ValueError, match="seq_lens"):
        mgpu_mfa_decode(q, jnp.ones((1, 32, 512), BF16), bt, lens[:, None], **kw)
    monkeypatch.setattr(m, "platform", lambda: "cuda")
    B, H, D, bs, nb = 2, 64, 256, 16, 8
    args = (jax.ShapeDtypeStruct((B, H, D), BF16), jax.ShapeDtypeStruct((1, B * nb * bs, 2 * D), BF16),
            jax.ShapeDtypeStruct((B, nb), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    for splits in (1, 2):
        f = jax.jit(functools.partial(mgpu_mfa_decode, block_size=bs, scale=0.1, layer=0, out_dtype=BF16,
                                      num_splits=splits, interpret=False))
        assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter run (CPU)")
def test_mfa_selected_through_mfa_decode_run(monkeypatch):
    """mfa_decode.run with mfa_kernel=mgpu forced takes the Mosaic GPU kernel (64-head multiples over bf16;
    else the Pallas kernel) and equals the XLA path and float64 attention."""
    from moejax.kernels import common, mfa_decode
    monkeypatch.setenv(common.MFA_KERNEL_ENV, "mgpu")
    B, H, D, bs, nb = 2, 64, 128, 16, 6
    k = jax.random.split(jax.random.key(fresh_key_seed()), 3)
    slots = B * nb * bs + bs
    cache = jax.random.normal(k[0], (2, slots, 2 * D)).astype(BF16)
    q = jax.random.normal(k[1], (B, H, D)).astype(BF16)
    bt = jax.random.permutation(k[2], slots // bs)[:B * nb].reshape(B, nb).astype(jnp.int32)
    lens = jnp.asarray([77, 5], jnp.int32)
    assert mfa_decode.plan(B, H, D, 1, nb * bs, bs, cache.dtype, "pallas").path == "mgpu"
    assert mfa_decode.plan(B, 48, D, 1, nb * bs, bs, cache.dtype, "pallas").path == "pallas"  # 48 heads
    assert mfa_decode.plan(B, H, D, 1, nb * bs, bs, jnp.float8_e4m3fn, "pallas").path == "pallas"  # FP8
    with common.kernel_mode("pallas"):
        got = mfa_decode.run(q, cache, bt, lens, bs, D ** -0.5, 1, layer=1)
    exact = mfa_reference(q, cache[1].astype(jnp.float32), bt, lens, bs, D ** -0.5)
    xla = mfa_decode.xla(q, cache, bt, lens, bs, D ** -0.5, 1, layer=1)
    assert rel_err(got, exact) < 1e-2 and rel_err(got, xla) < 1e-2
