"""Checkpoint loading: sharded index, FP8 dequantisation, orbax round trip, and named errors."""

import json
import os

import jax
import numpy as np
import pytest
import torch

import moejax
from conftest import rel_err
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
from moejax.weights.safetensors_io import SafetensorsFile, save_safetensors


def _load(path, **kw):
    return moejax.load(path, dtype="float32", max_model_len=64, max_num_seqs=2, progress=False, **kw)


def test_fp8_checkpoint_dequantised_on_load(tmp_path):
    """An HF-written FP8 (block-scaled e4m3) checkpoint: logits against the HF transformers model
    that wrote it (rel 1e-4)."""
    ref = make_hf_checkpoint(str(tmp_path), preset("v3-tiny", initializer_range=0.1), seed=3, fp8=True)
    f = SafetensorsFile(os.path.join(tmp_path, "model.safetensors"))
    assert str(f.get("model.layers.1.mlp.experts.0.up_proj.weight").dtype) == "float8_e4m3fn"
    ids = np.random.default_rng().integers(0, 320, size=(1, 13))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    assert rel_err(_load(str(tmp_path)).score(ids), want) < 1e-4


def test_sharded_checkpoint_with_index(tmp_path):
    """A checkpoint sharded with an index gives exactly the logits of the same weights in one file."""
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    make_random_checkpoint(str(sharded), preset("v2-lite-tiny"), seed=2, max_shard_bytes=200_000)
    make_random_checkpoint(str(single), preset("v2-lite-tiny"), seed=2)
    assert os.path.exists(sharded / "model.safetensors.index.json")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    assert not os.path.exists(single / "model.safetensors.index.json")
    m = _load(str(sharded))
    assert m.score([[3, 4, 5]]).shape == (1, 3, 320)
    ids = np.random.default_rng().integers(0, 320, size=(2, 11))
    np.testing.assert_array_equal(m.score(ids), _load(str(single)).score(ids))


def test_numpy_written_checkpoint_loads_in_transformers(tmp_path):
    """The embedded default's checkpoint is real HF layout: transformers loads it strictly."""
    from transformers import AutoModelForCausalLM
    make_random_checkpoint(str(tmp_path), preset("v3-tiny"), seed=4)
    ref, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = np.random.default_rng().integers(0, 320, size=(1, 9))
    with torch.no_grad():
        want = ref.eval()(torch.tensor(ids)).logits.numpy()
    assert rel_err(_load(str(tmp_path)).score(ids), want) < 1e-4


def test_orbax_save_and_restore(tmp_path):
    """moejax.save then load: exactly the logits and the greedy tokens of the model that was saved."""
    src, dst = tmp_path / "hf", tmp_path / "saved"
    make_random_checkpoint(str(src), preset("v3-tiny"), seed=5)
    m = _load(str(src))
    moejax.save(m, str(dst))
    m2 = _load(str(dst))
    ids = np.random.default_rng().integers(0, 320, size=(1, 7))
    np.testing.assert_array_equal(m.score(ids), m2.score(ids))
    out = moejax.generate(m2, ["abc"], max_new_tokens=3)
    assert len(out[0].token_ids) >= 1
    assert out[0].token_ids == moejax.generate(m, ["abc"], max_new_tokens=3)[0].token_ids


def _rewrite(path, mutate):
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    mutate(tensors)
    save_safetensors(tensors, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("mutation,needle", [
    (lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight"), "model.layers.2.mlp.experts.5.down_proj.weight"),
    (lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight"), "model.layers.0.self_attn.kv_b_proj.weight"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.bogus.weight", np.ones(3, np.float32)), "bogus"),
    (lambda t: t.__setitem__("model.norm.weight", np.ones(7, np.float32)), "model.norm.weight"),
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.3.gate_proj.weight", np.ones((4, 4), np.float32)),
     "experts.3.gate_proj"),
])
def test_bad_tensors_are_named(tmp_path, mutation, needle):
    """Invariant: a missing, unexpected or misshapen tensor is refused with an error naming it."""
    make_random_checkpoint(str(tmp_path), preset("v3-tiny"), seed=6)
    _rewrite(str(tmp_path), mutation)
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        _load(str(tmp_path))


def test_bad_load_arguments(tmp_path):
    """Invariant: a bad dtype, max_model_len, path or unknown config field is refused with an error naming it."""
    make_random_checkpoint(str(tmp_path), preset("v3-tiny"), seed=7)
    with pytest.raises(ValueError, match="dtype"):
        moejax.load(str(tmp_path), dtype="float16")
    with pytest.raises(ValueError, match="max_model_len"):
        moejax.load(str(tmp_path), max_model_len=10**9)
    with pytest.raises(ValueError, match="not a directory"):
        moejax.load(str(tmp_path / "nope"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mystery"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mystery"):
        moejax.load(str(tmp_path))


def test_dummy_load_format_from_a_preset(tmp_path):
    """load_format="dummy" with a preset name: random weights at its shapes (no checkpoint files) and the
    tiny tokenizer, smaller than the model's vocabulary; text and token-id prompts above the tokenizer's
    ids generate; moejax.save writes a checkpoint that loads back with the same weights."""
    from moejax.tiny.tokenizer import VOCAB_USED
    m = _load("v3-tiny", load_format="dummy")
    assert m.source_dir == "v3-tiny" and m.config.model.vocab_size == 320 and m.tokenizer.vocab_size == VOCAB_USED
    out = moejax.generate(m, ["abc", [3, 4, 300, 319]], max_new_tokens=3, ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert all(0 <= t < 320 for o in out for t in o.token_ids)
    moejax.save(m, str(tmp_path))
    again = moejax.load(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=2, progress=False)
    assert again.tokenizer.vocab_size == VOCAB_USED
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dummy_load_format_from_a_config_directory(tmp_path):
    """load_format="dummy" with a directory holding config.json and tokenizer files (a checkpoint without
    its weights): its tokenizer, and the other load arguments (weight_dtype="fp8": FP8 leaves; parallel:
    the leaves sharded over the layout's mesh)."""
    from moejax.tiny.tokenizer import write_tokenizer
    (tmp_path / "config.json").write_text(json.dumps(preset("v2-lite-tiny")))
    write_tokenizer(str(tmp_path))
    m = _load(str(tmp_path), load_format="dummy", weight_dtype="fp8", parallel="dp2-ep2")
    assert m.tokenizer_dir == str(tmp_path) and m.config.model.num_hidden_layers == 3
    leaves = jax.tree.leaves(m.params)
    assert any(leaf.dtype == jax.numpy.float8_e4m3fn for leaf in leaves)
    assert m.params["layers_1"]["mlp"]["experts"]["up_proj"].sharding.mesh.size == 2


def test_bad_load_format_arguments(tmp_path):
    """Invariant: a bad load_format, or under "dummy" a path that is neither a preset nor a directory
    holding config.json, is refused with an error naming the field (and listing the presets)."""
    with pytest.raises(ValueError, match="load_format"):
        moejax.load("v3-tiny", load_format="dumy")
    with pytest.raises(ValueError, match="path 'deepseek-v9'.*presets: .*deepseek-v3"):
        moejax.load("deepseek-v9", load_format="dummy")
    with pytest.raises(ValueError, match="has no config.json.*deepseek-v3"):
        moejax.load(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="not a directory"):  # a preset name is no checkpoint
        moejax.load("v3-tiny")
