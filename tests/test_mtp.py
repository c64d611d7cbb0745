"""DeepSeek-V3's multi-token-prediction (MTP) layer, loaded instead of dropped (issue 32, first step):
the config field, the HF-layout tensors at layer num_hidden_layers (FP8 as the rest), the MTP forward
against a float64 reference, moejax.save/load, the main model unchanged by it, named errors, and
its experts sharded and placed like any MoE layer's over dp2-ep2.

The tiny checkpoints are v3-tiny (3 layers, the MTP layer is ``model.layers.3.*``) written by the NumPy
writer with a fresh seed: transformers' DeepseekV3 has no MTP layer."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import moejax
from moejax.layers.forward_batch import ForwardBatch
from moejax.models.deepseek import require_mtp
from moejax.models.registry import abstract_params, parse_model_config
from moejax.parallel.sharding import EXPERT, RANK, REPLICATED, param_specs
from moejax.tiny.checkpoint import make_random_checkpoint, write_checkpoint
from moejax.tiny.presets import preset
from moejax.weights.param_tree import flatten
from moejax.weights.safetensors_io import CheckpointReader, SafetensorsFile, save_safetensors

CFG = preset("v3-tiny", num_nextn_predict_layers=1)
L = CFG["num_hidden_layers"]  # the MTP layer's index
LAYER = f"layers_{L}"
MTP = f"model.layers.{L}."
KW = dict(dtype="float32", max_model_len=64, max_num_seqs=4, progress=False)
MTP_ONLY = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")  # not a decoder layer's


def tok_close(got, want, tol):
    """Every token's logits within ``tol`` (relative) but at most one: float32 against float64 (or one
    device against two) sums in another order, so a router near-tie can pick another expert for one token."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    return int((err.reshape(-1) > tol).sum()) <= 1, float(np.median(err))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The tiny V3 checkpoint with an MTP layer (fresh seed), and the same tensors without it."""
    seed = int(np.random.default_rng().integers(1 << 30))
    mtp = make_random_checkpoint(str(tmp_path_factory.mktemp("mtp")), CFG, seed=seed, std=0.1)
    files = CheckpointReader(mtp)
    main = {n: np.array(files.get(n)) for n in files if not n.startswith(MTP)}
    plain = str(tmp_path_factory.mktemp("plain"))
    write_checkpoint(plain, dict(CFG, num_nextn_predict_layers=0), main)
    return {"mtp": mtp, "plain": plain, "main_tensors": main, "seed": seed}


_MODELS: dict = {}


def _load(path, **kw):
    key = (path, tuple(sorted(kw.items())))
    if key not in _MODELS:
        _MODELS[key] = moejax.load(path, **{**KW, **kw})
    return _MODELS[key]


def _vars(m):
    return {"params": m.params, "routing": m.routing}


def _main_hidden(m, ids):
    """The main model's hidden states (before its final norm) of prompts ids [B, S]."""
    B, S = ids.shape
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    f = jax.jit(lambda v, t, p: m.module.apply(v, t, ForwardBatch.prefill(p, jnp.full((B,), S, jnp.int32)),
                                                 method="prefill")[0])
    return f(_vars(m), jnp.asarray(ids, jnp.int32), pos)


def _mtp(m, tokens, positions, prev):
    """(eh_proj's output, the MTP layer's hidden states, its logits), one device, jitted."""
    B, S = tokens.shape

    def f(v, t, p, h):
        hm, _ = m.module.apply(v, t, h, ForwardBatch.prefill(p, jnp.full((B,), S, jnp.int32)), method="mtp_hidden")
        x = m.module.apply(v, t, h, method=lambda mod, t, h: mod.mtp.project(mod.embed_tokens(t), h))
        return x, hm, m.module.apply(v, hm, method="mtp_logits")
    return [np.asarray(a) for a in jax.jit(f)(_vars(m), jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), prev)]


def _inputs(m, rng, B=2, S=12):
    """The MTP inputs of random prompts as a drafter gives them: row i pairs the main model's hidden state
    at position i with the token at i + 1, at position i."""
    ids = rng.integers(2, 320, size=(B, S))
    h = _main_hidden(m, ids)
    return ids[:, 1:], np.broadcast_to(np.arange(S - 1, dtype=np.int32), (B, S - 1)), h[:, :-1]


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _reference(ckpt, tmp, tokens, positions, prev):
    """float64: x = eh_proj(concat(enorm(embed(tokens)), hnorm(prev))) in NumPy; then the MTP layer's
    decoder layer and shared head as HF transformers' DeepseekV3 (an independent implementation) of one
    layer, an MoE one, holding the MTP layer's tensors, its final norm and lm_head the shared_head's,
    run in float64 on inputs_embeds x (its router scores in float32, as HF computes them)."""
    from transformers import DeepseekV3ForCausalLM
    files = CheckpointReader(ckpt)
    g = lambda n: np.asarray(files.get(n), np.float64)  # noqa: E731
    eps = CFG["rms_norm_eps"]
    e = g("model.embed_tokens.weight")[tokens]
    x = np.concatenate([_rms(e, g(MTP + "enorm.weight"), eps), _rms(np.asarray(prev, np.float64),
                                                                     g(MTP + "hnorm.weight"), eps)], -1)
    x = x @ g(MTP + "eh_proj.weight").T
    tensors = {"model.embed_tokens.weight": np.array(files.get("model.embed_tokens.weight")),
               "model.norm.weight": np.array(files.get(MTP + "shared_head.norm.weight")),
               "lm_head.weight": np.array(files.get(MTP + "shared_head.head.weight"))}
    for n in files:
        if n.startswith(MTP) and n[len(MTP):].split(".")[0] not in MTP_ONLY:
            tensors["model.layers.0." + n[len(MTP):]] = np.array(files.get(n))
    write_checkpoint(tmp, dict(CFG, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0),
                     tensors)
    ref = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float64, attn_implementation="eager",
                                                experts_implementation="eager").eval()  # grouped_mm has no float64
    with torch.no_grad():
        out = ref(inputs_embeds=torch.tensor(x), position_ids=torch.tensor(np.asarray(positions, np.int64)))
    return x, out.logits.numpy()


def test_config_field():
    """num_nextn_predict_layers: 1 in the deepseek-v3 preset (as DeepSeek's config.json), 0 by default; more
    than DeepSeek ships (1), or not an integer, is refused naming the field; the MTP layer's cache rows
    would be one more cache layer; a config without it refuses what needs it (speculative decoding)."""
    assert parse_model_config(preset("deepseek-v3")).num_nextn_predict_layers == 1
    plain, mtp = parse_model_config(preset("v3-tiny")), parse_model_config(CFG)
    assert (plain.num_nextn_predict_layers, plain.num_cache_layers) == (0, L)
    assert (mtp.num_nextn_predict_layers, mtp.num_cache_layers) == (1, L + 1)
    for field in ("num_nextn_predict_layers", "num_mtp_layers"):
        for value in (2, -1, 1.5, "1", True):
            with pytest.raises(ValueError, match=field):
                parse_model_config(dict(preset("v3-tiny"), **{field: value}))
    assert parse_model_config(dict(preset("v3-tiny"), num_mtp_layers=1)).num_nextn_predict_layers == 1
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0.*speculative decoding"):
        require_mtp(plain)


def test_mtp_tensors_load(ckpts):
    """Every leaf the MTP layer declares is loaded at layers_3 with its declared shape and dtype, equal to the
    checkpoint's tensor (experts stacked [E, in, out]); the checkpoint's copy of the embedding is not stored
    (it equals the main one, which the MTP forward reads); the main model's logits are exactly those of the
    same checkpoint without the MTP layer. Without MTP the model refuses the MTP methods by name."""
    m = _load(ckpts["mtp"])
    got, want = flatten(m.params), flatten(abstract_params(m.config.model, "float32"))
    assert got.keys() == want.keys()
    layer = {p for p in want if p[0] == LAYER}
    assert {p[1] for p in layer} == {"enorm", "hnorm", "eh_proj", "shared_head", "self_attn", "mlp",
                                     "input_layernorm", "post_attention_layernorm"}
    assert all(got[p].shape == want[p].shape and got[p].dtype == want[p].dtype for p in layer)
    H, V, E = CFG["hidden_size"], CFG["vocab_size"], CFG["n_routed_experts"]
    assert got[LAYER, "eh_proj", "weight"].shape == (H, 2 * H)
    assert got[LAYER, "shared_head", "head", "weight"].shape == (V, H)
    assert got[LAYER, "mlp", "experts", "gate_proj"].shape == (E, H, CFG["moe_intermediate_size"])
    files = CheckpointReader(ckpts["mtp"])
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "mlp.gate.weight", "self_attn.kv_b_proj.weight"):
        np.testing.assert_array_equal(np.asarray(got[(LAYER, *name.split("."))]), files.get(MTP + name))
    e = int(np.random.default_rng().integers(E))
    np.testing.assert_array_equal(np.asarray(got[LAYER, "mlp", "experts", "down_proj"][e]),
                                  np.asarray(files.get(MTP + f"mlp.experts.{e}.down_proj.weight")).T)
    np.testing.assert_array_equal(files.get(MTP + "embed_tokens.weight"), np.asarray(got["embed_tokens", "weight"]))

    plain = _load(ckpts["plain"])
    assert not any(p[0] == LAYER for p in flatten(plain.params))
    ids = np.random.default_rng().integers(0, 320, size=(2, 9))
    np.testing.assert_array_equal(m.score(ids), plain.score(ids))
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        _mtp(plain, ids, np.broadcast_to(np.arange(9, dtype=np.int32), (2, 9)), np.zeros((2, 9, 64), np.float32))


def test_mtp_forward_matches_float64_reference(ckpts, tmp_path):
    """The MTP forward (prefill form, no cache) on the main model's hidden states: eh_proj's output within
    1e-6 (relative) of float64 NumPy, the logits of every token within 1e-5 of the float64 reference but
    one (a router near-tie). Measured: 2.2e-7 and at most 3.7e-7 (float32 rounding), seeds 1-3."""
    m = _load(ckpts["mtp"])
    tokens, positions, prev = _inputs(m, np.random.default_rng())
    x, _, logits = _mtp(m, tokens, positions, prev)
    x_ref, want = _reference(ckpts["mtp"], str(tmp_path), tokens, positions, prev)
    assert float(np.linalg.norm(x - x_ref) / np.linalg.norm(x_ref)) < 1e-6
    ok, median = tok_close(logits, want, 1e-5)
    assert ok, f"seed {ckpts['seed']}: median token error {median:.2e}"


def test_save_load_round_trip(ckpts, tmp_path):
    """moejax.save then load: every leaf, the MTP layer's included, bit for bit, and the same MTP logits. A save
    from before MTP was loaded (its marker without the field, no MTP leaves) is refused, naming the field."""
    m = _load(ckpts["mtp"])
    out = tmp_path / "saved"
    moejax.save(m, str(out))
    marker = json.loads((out / "moejax.json").read_text())
    assert marker["num_nextn_predict_layers"] == 1
    m2 = moejax.load(str(out), **KW)
    a, b = flatten(m.params), flatten(m2.params)
    assert a.keys() == b.keys() and any(p[0] == LAYER for p in b)
    for p in a:
        assert a[p].dtype == b[p].dtype and np.array_equal(np.asarray(a[p]).view(np.uint8),
                                                           np.asarray(b[p]).view(np.uint8)), p
    tokens, positions, prev = _inputs(m, np.random.default_rng(), S=6)
    np.testing.assert_array_equal(_mtp(m, tokens, positions, prev)[2], _mtp(m2, tokens, positions, prev)[2])
    del marker["num_nextn_predict_layers"]
    (out / "moejax.json").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="num_nextn_predict_layers 1.*save it again"):
        moejax.load(str(out), **KW)


def _rewrite(path, mutate):
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    mutate(tensors)
    save_safetensors(tensors, os.path.join(path, "model.safetensors"))


def _set(name, shape):
    return lambda t: t.__setitem__(name, np.ones(shape, np.float32))


def _pop(name):
    return lambda t: t.pop(name)


@pytest.mark.parametrize("mutation,needle", ids=[
    "missing-eh_proj", "missing-hnorm", "missing-head", "missing-expert", "missing-fused-part", "misshapen-eh_proj",
    "misshapen-norm", "embedding-differs"], argvalues=[
    (_pop(MTP + "eh_proj.weight"), re.escape(MTP + "eh_proj.weight")),
    (_pop(MTP + "hnorm.weight"), re.escape(MTP + "hnorm.weight")),
    (_pop(MTP + "shared_head.head.weight"), re.escape(MTP + "shared_head.head.weight")),
    (_pop(MTP + "mlp.experts.7.up_proj.weight"), re.escape(MTP + "mlp.experts.7.up_proj.weight")),
    (_pop(MTP + "self_attn.q_a_proj.weight"), re.escape(MTP + "self_attn.q_a_proj.weight")),
    (_set(MTP + "eh_proj.weight", (64, 64)), re.escape(MTP + "eh_proj.weight")),
    (_set(MTP + "shared_head.norm.weight", (63,)), re.escape(MTP + "shared_head.norm.weight")),
    (lambda t: t[MTP + "embed_tokens.weight"].__setitem__((5, 0), 9.0),
     re.escape(MTP + "embed_tokens.weight") + ".* differs from 'model.embed_tokens.weight'"),
])
def test_bad_mtp_tensors_are_named(ckpts, tmp_path, mutation, needle):
    """A missing or misshapen MTP tensor, or an MTP embedding other than the main one, is refused naming it."""
    path = shutil.copytree(ckpts["mtp"], tmp_path / "ckpt")
    _rewrite(str(path), mutation)
    with pytest.raises(ValueError, match=needle):
        moejax.load(str(path), **KW)


def test_checkpoint_without_its_mtp_layer_loads_without_it(ckpts, tmp_path):
    """A config saying num_nextn_predict_layers 1 over a checkpoint holding no MTP tensor at all (converted
    without it) loads as before MTP was loaded: without the layer, saying so; the same logits."""
    write_checkpoint(str(tmp_path), CFG, ckpts["main_tensors"])
    with pytest.warns(UserWarning, match="no tensor of its MTP layer"):
        m = moejax.load(str(tmp_path), **KW)
    assert m.config.model.num_nextn_predict_layers == 0 and m.hf_config["num_nextn_predict_layers"] == 0
    ids = np.random.default_rng().integers(0, 320, size=(1, 7))
    np.testing.assert_array_equal(m.score(ids), _load(ckpts["plain"]).score(ids))


def test_fp8_checkpoint_mtp_stays_fp8(tmp_path):
    """An FP8 checkpoint's MTP layer through the same loader paths: its projections float8 on the device with
    their scales (the decoder layer's, as every layer's), eh_proj and shared_head.head in the model dtype
    (bf16 in DeepSeek's checkpoint); the MTP logits of every token within 1e-5 of the same checkpoint
    dequantised on load (weight_dtype="bf16") but one."""
    seed = int(np.random.default_rng().integers(1 << 30))
    path = make_random_checkpoint(str(tmp_path), CFG, seed=seed, std=0.1, fp8=True)
    files = CheckpointReader(path)
    assert files.get(MTP + "mlp.experts.0.gate_proj.weight").dtype == ml_dtypes.float8_e4m3fn
    assert files.get(MTP + "eh_proj.weight").dtype == np.float32 and MTP + "eh_proj.weight_scale_inv" not in files
    m = moejax.load(path, **KW)
    flat = flatten(m.params)
    fp8 = ml_dtypes.float8_e4m3fn
    for p in [(LAYER, "mlp", "experts", "gate_proj"), (LAYER, "self_attn", "o_proj", "weight"),
              (LAYER, "self_attn", "q_b_proj", "weight"), (LAYER, "mlp", "shared_experts", "up_proj", "weight")]:
        assert flat[p].dtype == fp8 and p[:-1] + (p[-1] + "_scale_inv",) in flat, p
    assert flat[LAYER, "eh_proj", "weight"].dtype == np.float32
    assert flat[LAYER, "shared_head", "head", "weight"].dtype == np.float32
    deq = moejax.load(path, weight_dtype="bf16", **KW)
    tokens, positions, prev = _inputs(deq, np.random.default_rng())
    ok, median = tok_close(_mtp(m, tokens, positions, prev)[2], _mtp(deq, tokens, positions, prev)[2], 1e-5)
    assert ok, f"seed {seed}: median token error {median:.2e}"


def test_mtp_sharded_and_placed_like_a_decoder_layer(ckpts):
    """dp2-ep2: the MTP layer's routed experts (and nothing else of it) split over the expert axis like layer
    1's; its experts placed contiguously like every MoE layer's, routing tables included, but not
    rebalanced by EPLB (no step counts their load yet); the MTP forward under shard_map with the EP
    dispatch gives one device's logits (every token within 1e-5 but one)."""
    m = _load(ckpts["mtp"], parallel="dp2-ep2")
    specs = flatten(param_specs(m.params))
    for p, a in flatten(m.params).items():
        if p[0] == LAYER:
            assert a.sharding.spec == specs[p] == (EXPERT if p[1:3] == ("mlp", "experts") else REPLICATED), p
            if ("layers_1",) + p[1:] in specs:  # a decoder layer's leaf: the same spec as layer 1's
                assert specs[p] == specs[("layers_1",) + p[1:]], p
    assert m.params[LAYER]["mlp"]["experts"]["gate_proj"].addressable_shards[0].data.shape[0] == \
        CFG["n_routed_experts"] // 2
    module = (LAYER, "mlp", "experts")
    assert module in m.placements and "expert_slots" in m.routing[LAYER]["mlp"]["experts"]
    np.testing.assert_array_equal(m.placements[module].logical_of_slot, np.arange(CFG["n_routed_experts"]))
    balancer = m.engine.balancer
    assert module not in balancer.names and len(balancer.names) == L - CFG["first_k_dense_replace"]
    rng = np.random.default_rng()

    one = _load(ckpts["mtp"])
    tokens, positions, prev = _inputs(one, rng, B=4, S=8)
    want = _mtp(one, tokens, positions, prev)[2]
    N, B, S = 2, 2, tokens.shape[1]

    def per_rank(params, routing, t, p, h):
        v = {"params": params, "routing": routing}
        hm, _ = m.module.apply(v, t[0], h[0], ForwardBatch.prefill(p[0], jnp.full((B,), S, jnp.int32)),
                               method="mtp_hidden")
        return m.module.apply(v, hm, method="mtp_logits")[None]

    fn = jax.jit(jax.shard_map(per_rank, mesh=m.mesh, in_specs=(param_specs(m.params), REPLICATED, RANK, RANK, RANK),
                               out_specs=RANK, check_vma=False))
    got = fn(m.params, m.routing, jnp.asarray(tokens, jnp.int32).reshape(N, B, S),
             jnp.asarray(positions).reshape(N, B, S), jnp.asarray(prev).reshape(N, B, S, -1))
    ok, median = tok_close(np.asarray(got).reshape(want.shape), want, 1e-5)
    assert ok, f"seed {ckpts['seed']}: median token error {median:.2e}"

    # A rebalance moves the decoder layers' experts; the MTP layer's stay where they were.
    balancer.rebalance(rng.integers(0, 1000, size=(len(balancer.names), CFG["n_routed_experts"])))
    np.testing.assert_array_equal(balancer.placements[module].logical_of_slot, np.arange(CFG["n_routed_experts"]))
    assert "expert_slots" in balancer.runner.routing[LAYER]["mlp"]["experts"]
