"""Every operation's plan (moejax/kernels/) against the outcome the rules gave before they moved there:
tests/data/kernel_plans.json.gz was recorded from moejax/kernel_selection.py at af260ea (its select_*
functions plus the dispatch its callers ran: the Triton bf16 MoE, the Triton W8A8 MoE and dense GEMM,
cuBLASLt, the dequantised bf16 experts) over the cases below, under CPU, CUDA and ROCm, with and without
jax-triton and cuBLASLt, and under each kernel override; a change of outcome fails here. The whole grid
(34,008 cases) was compared once when the package was made; the file keeps a third of it.
Rule changes since, re-recorded (only the cases named changed): 2026-12-07, W8A8 dense GEMMs from
DENSE_W8A8_ROWS[0] rows on CUDA with cuBLASLt built run cuBLASLt (24 cases were Pallas); 2026-12-07b, MLA
query rows together only below 64 heads (mla_decode.rows_together; 128 cases); 2026-12-07c, bf16 routed
experts at 33-64 rows an expert on one 64-row tile (moe.PALLAS_TILES; 60 cases, the FP8 experts unchanged).
2026-12-07d, MLA/MFA decode over an FP8 cache below 64 heads on Pallas's gather tile (32 tokens, 2 stages;
on CUDA in place of Triton for one row a sequence; 288 cases).
And each layer entry point returns an array on every path (XLA, and the kernels in the interpreter)."""

import gzip
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import common, fp8_gemm, mfa_decode, mla_decode, moe, moe_fp8, prefill
from pallas_kernels import cublaslt_fp8_gemm, jax_triton_compat

DATA = pathlib.Path(__file__).parent / "data" / "kernel_plans.json.gz"
OVERRIDE_ENVS = (common.MOE_KERNEL_ENV, common.W8A8_KERNEL_ENV, common.W8A8_DENSE_KERNEL_ENV, common.MLA_KERNEL_ENV)


def _dt(name):
    return jnp.dtype(name)


def _as_json(plan):
    if plan.path == "dequantised":
        return ["dequantised", {"bf16": [plan.params["bf16"].path, plan.params["bf16"].params]}]
    return json.loads(json.dumps([plan.path, plan.params]))


def outcome(op, a, mode):
    """The plan of ``op`` for the static arguments ``a`` (variant "auto" resolved first, as the layers do)."""
    if op == "moe":
        return _as_json(moe.plan(*a[:4], _dt(a[4]), mode))
    if op == "moe_fp8":
        rows, E, H, I, d, wdt, v = a
        return _as_json(moe_fp8.plan(rows, E, H, I, _dt(d), _dt(wdt), moe_fp8.pick_variant(v, rows, E, _dt(wdt)), mode))
    if op == "fp8_gemm":
        M, N, K, d, wdt, v = a
        return _as_json(fp8_gemm.plan(M, N, K, _dt(d), _dt(wdt), fp8_gemm.pick_variant(v, M, _dt(wdt)), mode))
    if op == "mla":
        return _as_json(mla_decode.plan(*a[:6], _dt(a[6]), mode, rows=a[7]))
    if op == "mfa":
        return _as_json(mfa_decode.plan(*a[:6], _dt(a[6]), mode))
    if op == "prefill":
        return _as_json(prefill.plan(*a[:8], _dt(a[8]), mode))
    if op == "prefill_segment":
        return ["segment", {"tokens": prefill.segment(*a)}]
    if op == "fuse_shared":
        with common.kernel_mode(mode):
            return ["fuse", {"on": moe.fuse_shared_experts(*a[:3], _dt(a[3]))}]
    raise ValueError(f"op {op!r}")


def _records():
    data = json.loads(gzip.decompress(DATA.read_bytes()))
    return [dict(zip(data["fields"], row), outcome=data["outcomes"][row[-1]]) for row in data["cases"]]


def test_plans_keep_the_previous_rules_outcomes(monkeypatch):
    """Invariant: for each recorded case (platform, jax-triton / cuBLASLt present or not, override
    environment, mode, static shapes), the plan's path and params equal the recorded outcome."""
    records = _records()
    assert len(records) > 5000 and {r["op"] for r in records} == {
        "moe", "moe_fp8", "fp8_gemm", "mla", "mfa", "prefill", "prefill_segment", "fuse_shared"}
    assert {r["outcome"][0] for r in records} >= {"xla", "pallas", "triton", "cublaslt", "dequantised"}
    wrong = []
    for r in records:
        monkeypatch.setattr(common, "platform", lambda p=r["platform"]: p)
        monkeypatch.setattr(jax_triton_compat, "available", lambda t=r["triton"]: (t, "" if t else "absent"))
        monkeypatch.setattr(cublaslt_fp8_gemm, "available", lambda t=r["cublaslt"]: (t, "" if t else "absent"))
        for env in OVERRIDE_ENVS:
            monkeypatch.delenv(env, raising=False)
        for k, v in r["env"].items():
            monkeypatch.setenv(k, v)
        got = outcome(r["op"], r["args"], r["mode"])
        if got != r["outcome"]:
            wrong.append((r, got))
    assert not wrong, f"{len(wrong)} plans changed, first: {wrong[0]}"


# ------------------------------------------------------------------ a layer always gets an array
@pytest.mark.parametrize("mode", ["xla", "pallas"])
def test_layer_entry_points_return_arrays(mode):
    """Each layer entry point returns an array of the documented shape (finite) whichever path its plan
    names: XLA, or the kernels (the Pallas interpreter on CPU). Numerics against references: the kernel
    test files. Seeded inputs (seed 41)."""
    from moejax.layers.experts import ExpertWeights, grouped_expert_mlp
    from moejax.layers.fp8_linear import fp8_linear
    from moejax.layers.paged_attention import mfa_decode_attention, mla_decode_attention
    from moejax.layers.prefill_attention import packed_prefill_attention, prefill_attention
    from moejax.weights.fp8 import quantize_block_fp8

    rng = np.random.default_rng(41)
    f32 = jnp.float32
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), f32)  # noqa: E731
    got = []
    with common.kernel_mode(mode):
        E, H, I, N = 2, 32, 32, 8
        gs = jnp.asarray([3, 5], jnp.int32)
        got.append(((N, H), grouped_expert_mlp(arr(N, H), gs, ExpertWeights(arr(E, H, I), arr(E, H, I), arr(E, I, H)))))
        q, s = quantize_block_fp8(rng.standard_normal((128, 128)).astype(np.float32))
        got.append(((4, 128), fp8_linear(arr(4, 128), jnp.asarray(q), jnp.asarray(s))))
        qs = [[quantize_block_fp8(rng.standard_normal((128, 128)).astype(np.float32)) for _ in range(E)]
              for _ in range(3)]  # per expert [out, in] (HF's layout), stacked
        w8 = [jnp.stack([jnp.asarray(w) for w, _ in m]) for m in qs]
        s8 = [jnp.stack([jnp.asarray(sc) for _, sc in m]) for m in qs]
        fp8 = ExpertWeights(w8[0], w8[1], w8[2], s8[0], s8[1], s8[2])
        got.append(((N, 128), grouped_expert_mlp(arr(N, 128), gs, fp8)))
        B, Hq, C, R, bs, nb = 2, 16, 32, 16, 4, 2
        cache = arr(B * nb * bs, C + R)
        tables = jnp.arange(B * nb, dtype=jnp.int32).reshape(B, nb)
        lens = jnp.asarray([5, 8], jnp.int32)
        got.append(((B, Hq, C), mla_decode_attention(arr(B, Hq, C), arr(B, Hq, R), cache, tables, lens, bs, 0.1)))
        D = 16
        mfa_cache = arr(B * nb * bs, 2 * D)
        got.append(((B, Hq, D), mfa_decode_attention(arr(B, Hq, D), mfa_cache, tables, lens, bs, 0.25, 1)))
        T = 8
        got.append(((1, T, 4, 16), prefill_attention(arr(1, T, 4, 16), arr(1, T, 4, 32), jnp.asarray([T]), scale=0.25)))
        got.append(((T, 4, 16), packed_prefill_attention(arr(T, 4, 16), arr(T, 4, 32), jnp.asarray([0, 3, T]),
                                                         scale=0.25)))
    for shape, y in got:
        assert isinstance(y, jax.Array) and y.shape == shape and bool(jnp.isfinite(y).all()), (shape, y)


def test_mla_on_hopper_takes_the_mosaic_gpu_kernel_for_bf16_caches(monkeypatch):
    """The rule added 2026-12-07f (outside the recorded grid, whose CPU-simulated cases see no Hopper): on a
    Hopper GPU, MLA decode over a bf16 cache with a multiple of 64 heads runs mgpu_mla_decode (its splits
    filling the GPU at small batch); an FP8 cache keeps Triton; 16 heads keep Pallas; an override still wins."""
    from pallas_kernels import mgpu_decode_attention
    monkeypatch.setattr(common, "platform", lambda: "cuda")
    monkeypatch.setattr(common, "hopper", lambda: True)
    monkeypatch.setattr(mgpu_decode_attention, "available", lambda: (True, ""))
    monkeypatch.setattr(jax_triton_compat, "available", lambda: (True, ""))
    monkeypatch.delenv(common.MLA_KERNEL_ENV, raising=False)
    bf16, fp8 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)
    p = mla_decode.plan(197, 128, 512, 64, 2048, 16, bf16)
    assert (p.path, p.params) == ("mgpu", {"block_t": 64, "num_stages": 2, "num_splits": 1})
    splits = lambda B, ctx: mla_decode.plan(B, 128, 512, 64, ctx, 16, bf16).params["num_splits"]  # noqa: E731
    assert (splits(16, 2048), splits(16, 8192), splits(64, 2048), splits(512, 8192)) == (2, 4, 1, 1)
    assert mla_decode.plan(197, 128, 512, 64, 2048, 16, fp8).path == "triton"
    assert mla_decode.plan(256, 16, 512, 64, 2048, 16, bf16).path == "pallas"
    assert mla_decode.plan(197, 128, 512, 64, 2048, 64, bf16).path == "mgpu"  # 64-token pages: one a tile
    assert mla_decode.plan(197, 128, 512, 64, 2048, 128, bf16).path != "mgpu"  # a page bigger than a tile
    # The verify's rows: each on its own by default (together not yet measured), together where mgpu is forced
    assert "rows" not in mla_decode.plan(197, 128, 512, 64, 2048, 16, bf16, rows=2).params
    monkeypatch.setenv(common.MLA_KERNEL_ENV, "mgpu")
    p = mla_decode.plan(16, 128, 512, 64, 8192, 16, bf16, rows=3)
    assert (p.path, p.params) == ("mgpu", {"block_t": 64, "num_stages": 2, "num_splits": 1, "rows": 3})  # 16 x 8 CTAs
    assert "rows" not in mla_decode.plan(16, 128, 512, 64, 8192, 16, bf16, rows=5).params  # 1 to 4 rows
    monkeypatch.setenv(common.MLA_KERNEL_ENV, "triton")
    assert mla_decode.plan(197, 128, 512, 64, 2048, 16, bf16).path == "triton"
    monkeypatch.setattr(common, "hopper", lambda: False)  # Ampere / ROCm: no Mosaic GPU kernel
    monkeypatch.delenv(common.MLA_KERNEL_ENV)
    assert mla_decode.plan(197, 128, 512, 64, 2048, 16, bf16).path == "pallas"
