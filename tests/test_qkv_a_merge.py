"""MLA's merged q_a / kv_a projection (``qkv_a_proj``, moejax/layers/mla.py): the loader builds it
from HF's two tensors bit for bit (bf16/f32 and FP8), it computes what the two GEMMs compute, the
layouts that keep them apart stay apart, and a missing half is named. Parity of the whole merged
model with transformers: tests/test_hf_parity.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.mla import MLA
from moejax.models.registry import abstract_params, family_of, load_model_config, parse_model_config
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from moejax.weights.loader import load_hf_params
from moejax.weights.param_tree import flatten
from moejax.weights.safetensors_io import CheckpointReader, SafetensorsFile, save_safetensors

Q_A, KV_A = "model.layers.{}.self_attn.q_a_proj.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"
ATTN = Fp8Policy.create(["attention"])


def _attn_leaves(cfg, fp8=NO_FP8):
    return {p[2] for p in flatten(abstract_params(cfg, "float32", fp8)) if p[0] == "layers_0" and p[1] == "self_attn"}


def test_which_layouts_merge():
    """With q_lora (V3) the two projections are one qkv_a_proj; without it (V2-Lite) nothing merges;
    under FP8 they merge only when q_lora_rank is a multiple of the 128-row block."""
    v3, lite = parse_model_config(preset("v3-tiny")), parse_model_config(preset("v2-lite-tiny"))
    v3_128 = parse_model_config(preset("v3-tiny", q_lora_rank=128))
    assert {"qkv_a_proj"} <= _attn_leaves(v3) and not {"q_a_proj", "kv_a_proj_with_mqa"} & _attn_leaves(v3)
    assert {"q_proj", "kv_a_proj_with_mqa"} <= _attn_leaves(lite) and "qkv_a_proj" not in _attn_leaves(lite)
    assert {"q_a_proj", "kv_a_proj_with_mqa"} <= _attn_leaves(v3, ATTN) and "qkv_a_proj" not in _attn_leaves(v3, ATTN)
    assert "qkv_a_proj" in _attn_leaves(v3_128, ATTN)


@pytest.mark.parametrize("q_lora,fp8", [(32, False), (128, True)])
def test_loaded_qkv_a_is_the_checkpoints_two_tensors_stacked(tmp_path, q_lora, fp8):
    """The loaded qkv_a_proj weight (and, FP8, its block scales) is [q_a_proj; kv_a_proj_with_mqa] of
    the file, bit for bit, in every layer."""
    hf = preset("v3-tiny", q_lora_rank=q_lora)
    d = make_random_checkpoint(str(tmp_path), hf, seed=int(np.random.default_rng().integers(2 ** 31)), fp8=fp8)
    cfg = load_model_config(d)  # with the FP8 checkpoint's quantization_config
    abstract = abstract_params(cfg, "float32", ATTN if fp8 else NO_FP8)
    got = flatten(load_hf_params(d, cfg, family_of(cfg), abstract, progress=False))
    f = CheckpointReader(d)
    for layer in range(cfg.num_hidden_layers):
        leaf = (f"layers_{layer}", "self_attn", "qkv_a_proj")
        names = [Q_A.format(layer), KV_A.format(layer)]
        want = np.concatenate([np.asarray(f.get(n)) for n in names])
        w = np.asarray(got[leaf + ("weight",)])
        assert w.dtype == want.dtype and w.shape == (q_lora + cfg.kv_cache_dim, cfg.hidden_size)
        assert np.array_equal(w.view(np.uint8), want.view(np.uint8))
        if fp8:
            s = np.concatenate([np.asarray(f.get(n + "_scale_inv")) for n in names])
            assert np.array_equal(np.asarray(got[leaf + ("weight_scale_inv",)]), s)


def test_merged_projection_computes_the_two_gemms():
    """Prefill and absorbed decode of one MLA layer with qkv_a_proj equal those with the two separate
    projections holding its rows (float32, 1e-5)."""
    cfg = parse_model_config(preset("v3-tiny"))
    rng = np.random.default_rng()
    B, S, nb, bs = 2, 5, 2, 16
    x = jnp.asarray(rng.standard_normal((B, S, cfg.hidden_size)), jnp.float32)
    pos = jnp.tile(jnp.arange(S, dtype=jnp.int32), (B, 1))
    sep, merged = MLA(cfg, 0, jnp.float32, merge_q_kv_a=False), MLA(cfg, 0, jnp.float32)
    p_sep = sep.init(jax.random.key(int(rng.integers(2 ** 31))), x, ForwardBatch.prefill(pos, jnp.full((B,), S)),
                     method="prefill")
    p_sep = jax.tree.map(lambda a: a * 5.0, p_sep)  # beyond init's 0.02: the outputs are not all ~0
    ps = dict(p_sep["params"])
    p_mrg = {"params": {**{k: v for k, v in ps.items() if k not in ("q_a_proj", "kv_a_proj_with_mqa")},
                        "qkv_a_proj": {"weight": jnp.concatenate([ps["q_a_proj"]["weight"],
                                                                  ps["kv_a_proj_with_mqa"]["weight"]])}}}
    cache = jnp.zeros((1, B * nb * bs, cfg.kv_cache_dim), jnp.float32)
    tables = jnp.arange(B * nb, dtype=jnp.int32).reshape(B, nb)
    slots = (tables[:, :1] * bs + pos).astype(jnp.int32)
    outs = []
    for m, p in ((sep, p_sep), (merged, p_mrg)):
        o, c = m.apply(p, x, ForwardBatch.prefill(pos, jnp.full((B,), S), slots), cache, method="prefill")
        step = ForwardBatch.decode(jnp.full((B,), S), slots[:, 0] + S, tables, jnp.full((B,), S + 1), bs)
        d, c = m.apply(p, x[:, -1] * 0.5, step, c, method="decode")
        outs.append((o, d, c))
    assert float(jnp.abs(outs[0][0]).max()) > 1e-3
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_a_missing_half_is_named(tmp_path):
    """A checkpoint without one of the two tensors is refused, naming the missing HF tensor."""
    make_random_checkpoint(str(tmp_path), preset("v3-tiny"), seed=1)
    path = str(tmp_path / "model.safetensors")
    f = SafetensorsFile(path)
    tensors = {k: np.array(f.get(k)) for k in f.keys() if k != KV_A.format(1)}
    save_safetensors(tensors, path)
    with pytest.raises(ValueError, match=KV_A.format(1).replace(".", r"\.")):
        cfg = parse_model_config(preset("v3-tiny"))
        load_hf_params(str(tmp_path), cfg, family_of(cfg), abstract_params(cfg, "float32"), progress=False)


def test_a_save_from_before_the_merge_is_refused(tmp_path):
    """A moejax.save directory of format_version 1 (separate q_a / kv_a leaves) is refused by name, not
    handed to orbax."""
    make_random_checkpoint(str(tmp_path), preset("v3-tiny"), seed=2)
    (tmp_path / "moejax.json").write_text(json.dumps({"format_version": 1, "dtype": "float32", "fp8_layers": []}))
    with pytest.raises(ValueError, match="format_version"):
        moejax.load(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=2, progress=False)
