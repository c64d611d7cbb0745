"""The Triton-language MLA decode kernel (pallas_kernels/triton_mla_decode.py) against float64 NumPy
attention over what the cache holds: on CPU in Triton's interpreter (needs ``triton`` and ``torch``;
skipped otherwise, said in the reason), on a GPU through jax-triton (``pytest
tests/test_triton_mla_decode.py`` on the device machine). Plus its sm_90 compile: wgmma, pipelined
copies, register spills (Triton's own compiler and ptxas on this machine, nothing run).

Seeds from the per-test seed (conftest; MOEJAX_TEST_SEED replays a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from moejax.kernels import mla_decode
from moejax.kernels.common import kernel_mode
from pallas_kernels.triton_mla_decode import triton_mla_decode
from test_kernels import BF16, fresh_key_seed, mla_inputs, mla_reference, rel_err, stored_cache
from test_triton_fp8 import pytestmark  # noqa: F401 (the same skip: jax-triton on a GPU, the interpreter on CPU)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("B,H,C,R,block_size,nb,lens,block_h,block_n,splits", [
    (3, 20, 64, 16, 4, 12, [1, 29, 48], 16, 16, 1),   # heads padded past 20, one token, a ragged last tile
    (2, 16, 32, 16, 8, 8, [64, 3], 32, 16, 3),        # 3 splits, some empty for the short sequence
])
def test_matches_reference(kv, B, H, C, R, block_size, nb, lens, block_h, block_n, splits):
    """rel 1e-2 against the exact attention over the cache's contents (bf16 probabilities into the value
    dot, as on the GPU); bf16 output through the one-split path and the splits' combine alike."""
    values, ql, qr, bt = mla_inputs(fresh_key_seed(), B, H, C, R, block_size, nb)
    lens = jnp.asarray(lens, jnp.int32)
    scale = 1.2 / (C + R) ** 0.5
    cache, stored = stored_cache(values, kv, C + R)
    exact = mla_reference(ql, qr, stored, bt, lens, block_size, scale)
    kw = dict(block_size=block_size, scale=scale, layer=1, block_h=block_h, block_n=block_n, num_splits=splits)
    got = triton_mla_decode(ql, qr, cache, bt, lens, **kw)
    assert got.shape == (B, H, C) and got.dtype == jnp.float32
    assert rel_err(got, exact) < 1e-2
    gb = triton_mla_decode(ql, qr, cache, bt, lens, out_dtype=BF16, **kw)
    assert gb.dtype == BF16 and rel_err(gb, exact) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("Q,H,block_h,splits", [(2, 16, 32, 1), (3, 20, 64, 2), (4, 16, 64, 1)])
def test_several_query_rows_a_sequence(kv, Q, H, block_h, splits):
    """The speculative verify's Q = k + 1 rows a sequence in one launch (the context read once for all of
    them), row q attending to its own length (causal among the rows, and a ragged one), against float64
    attention of each row on its own; rows x heads padded past the program's block."""
    B, C, R, block_size, nb = 3, 32, 16, 4, 10
    values, ql, qr, bt = mla_inputs(fresh_key_seed(), B, Q * H, C, R, block_size, nb)
    ql, qr = ql.reshape(B, Q, H, C), qr.reshape(B, Q, H, R)
    last = jnp.asarray([Q, 23, 40], jnp.int32)  # a context of just the rows; a ragged tile; the whole table
    lens = last[:, None] - (Q - 1) + jnp.arange(Q, dtype=jnp.int32)[None, :]
    lens = lens.at[1, 0].set(5)  # any lengths, not only causal: row 0 of sequence 1 sees 5 tokens
    scale = 1.2 / (C + R) ** 0.5
    cache, stored = stored_cache(values, kv, C + R)
    exact = mla_reference(ql.reshape(B * Q, H, C), qr.reshape(B * Q, H, R), stored, jnp.repeat(bt, Q, axis=0),
                          lens.reshape(-1), block_size, scale).reshape(B, Q, H, C)
    got = triton_mla_decode(ql, qr, cache, bt, lens, block_size=block_size, scale=scale, layer=1, block_h=block_h,
                            block_n=16, num_splits=splits)
    assert got.shape == (B, Q, H, C)
    assert rel_err(got, exact) < 1e-2
    for b in range(B):  # every (sequence, row) right, not only the whole on average
        for q in range(Q):
            assert rel_err(got[b, q], exact[b, q]) < 2e-2, (b, q)


def test_bad_arguments_name_the_field():
    q, qr = jnp.ones((1, 16, 48), BF16), jnp.ones((1, 16, 16), BF16)
    cache = jnp.ones((2, 32, 64), BF16)
    kw = dict(block_size=16, scale=0.1)
    with pytest.raises(ValueError, match="latent dim"):
        triton_mla_decode(q, qr, cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), layer=0, **kw)
    q = jnp.ones((1, 16, 32), BF16)
    with pytest.raises(ValueError, match="layer"):
        triton_mla_decode(q, qr, cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), layer=2, **kw)
    with pytest.raises(ValueError, match="q_rope"):
        triton_mla_decode(q, qr[:, :8], cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), layer=0,
                          **kw)
    with pytest.raises(ValueError, match="seq_lens"):  # several rows a sequence: one length a row
        triton_mla_decode(q[:, None], qr[:, None], cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                          layer=0, **kw)


_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moejax.kernels import mla_decode
from pallas_kernels import triton_mla_decode as T


def compile_(*args, **kw):  # jax_triton empties TRITON_CACHE_DIR when (lazily) imported; compile needs one
    os.environ["TRITON_CACHE_DIR"] = os.environ["MOEJAX_TEST_TRITON_CACHE"]
    return triton.compile(*args, **kw)



p = {c: mla_decode.triton_params(512, 128, 2048, c == "fp8") for c in ("bf16", "fp8")}
out = {}
for cache, ty, D in (("bf16", "*bf16", 576), ("fp8", "*fp8e4nv", 592)):
    q = p[cache]
    sig = dict(ql_ptr="*bf16", qr_ptr="*bf16", cache_ptr=ty, bt_ptr="*i32", len_ptr="*i32", o_ptr="*bf16",
               lse_ptr="*fp32")
    consts = dict(H=128, M=128, MP=128, ROWS=1, C=512, R=64, D=D, NB=128, BS=16, LAYER_ROWS=60 * 2 ** 20, SPLIT_LEN=2048,
                  NUM_SPLITS=1, BH=q["block_h"], BN=q["block_n"], QK_SCALE=0.1, FP8=cache == "fp8", SCALE_COL=576)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(7)}  # as jax-triton marks XLA's buffers
    src = ASTSource(T._mla_decode_kernel.get(False), dict(sig, **{c: "constexpr" for c in consts}), consts, aligned)
    k = compile_(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=q["num_warps"], num_stages=q["num_stages"]))
    d = tempfile.mkdtemp()
    open(d + "/k.ptx", "w").write(k.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", d + "/k.ptx", "-o", d + "/k.cubin"],
                       capture_output=True, text=True)
    out[cache] = dict(wgmma=sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", k.asm["ptx"]))),
                      async_copies=k.asm["ttgir"].count("async_copy_global_to_local"), shared=k.metadata.shared,
                      spills=[int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)],
                      ptxas_rc=r.returncode, stages=q["num_stages"])
print(json.dumps(out))
"""


def test_compiles_to_wgmma_and_pipelined_copies(tmp_path):
    """The selected tilings at 128 heads (64 heads, 64 tokens, 8 warps; bf16 three stages, FP8 one)
    compiled for sm_90 on this machine: both dots on wgmma, within Hopper's shared memory; the bf16 cache
    tiles loaded by pipelined async copies with no spills (FP8 rows, widened in registers, spill a few
    hundred bytes: selected anyway, 1.96x XLA at 512 x 2048). A fresh process: Triton compiles only outside
    its interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)),
               MOEJAX_TEST_TRITON_CACHE=str(tmp_path))  # Triton's default (~/.triton) may not be writable
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for cache in ("bf16", "fp8"):
        g = got[cache]
        assert g["ptxas_rc"] == 0 and len(g["spills"]) == 1, g
        assert any("m64n256k16.f32.bf16.bf16" in w for w in g["wgmma"]), g
        assert g["shared"] <= 227 * 1024 and (g["async_copies"] > 0) == (g["stages"] > 1), g
    assert got["bf16"]["spills"] == [0] and got["bf16"]["stages"] > 1, got


@pytest.mark.parametrize("kernel", ["triton", "pallas"])
def test_verify_rows_through_the_model_entry(kernel, monkeypatch):
    """mla_decode_attention with Q rows a sequence and one block table a sequence (what the speculative
    verify passes): the Triton kernel takes the rows together, the Pallas kernel gets each row its own
    table; both equal the XLA path given a table a row, within bf16 rounding."""
    from moejax.layers.paged_attention import mla_decode_attention
    B, Q, H, C, R, block_size, nb = 2, 3, 16, 32, 16, 4, 8
    values, ql, qr, bt = mla_inputs(fresh_key_seed(), B, Q * H, C, R, block_size, nb)
    ql, qr = ql.reshape(B * Q, H, C), qr.reshape(B * Q, H, R)
    lens = (jnp.asarray([[9], [24]], jnp.int32) + jnp.arange(Q, dtype=jnp.int32)).reshape(-1)
    cache, _ = stored_cache(values, "bf16", C + R)
    kw = dict(block_size=block_size, scale=0.2, layer=1)
    with kernel_mode("xla"):
        ref = mla_decode_attention(ql, qr, cache, jnp.repeat(bt, Q, axis=0), lens, **kw)
    monkeypatch.setenv("MOEJAX_MLA_KERNEL", kernel)
    with kernel_mode("pallas"):
        together = "rows" in mla_decode.plan(B, H, C, R, nb * block_size, block_size, BF16, rows=Q).params
        assert together == (kernel == "triton")
        got = mla_decode_attention(ql, qr, cache, bt, lens, **kw)
    assert got.shape == (B * Q, H, C) and rel_err(got, ref) < 1e-2
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode_attention(ql, qr, cache, bt[:1].repeat(4, 0), lens, **kw)
