"""Step3 (StepFun) text model: MFA attention, softmax top-k MoE with a shared expert.

The reference below is written from the model description alone (float64 NumPy,
loops and einsums, its own safetensors reader): no moejax code.
"""

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

import moejax
from conftest import rel_err
from moejax.kernels import mfa_decode
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

VOCAB = 320


# ----------------------------------------------------------------------------------------------
# Independent float64 reference
# ----------------------------------------------------------------------------------------------
_ST_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_safetensors(directory):
    out = {}
    for fn in sorted(os.listdir(directory)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, fn), "rb") as f:
            raw = f.read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            dt = _ST_DTYPES[info["dtype"]]
            out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=dt).reshape(info["shape"])
    return out


def ref_weights(directory):
    """HF tensors as float64, FP8 blocks dequantised, VL prefixes stripped, vision tensors dropped."""
    raw = read_safetensors(directory)
    w = {}
    for name, arr in raw.items():
        if name.endswith("_scale_inv"):
            continue
        name_t = name.removeprefix("language_model.")
        if not (name_t.startswith("model.") or name_t.startswith("lm_head")):
            continue  # vision tower
        a = arr.astype(np.float64)
        if name + "_scale_inv" in raw:
            s = raw[name + "_scale_inv"].astype(np.float64)
            bo, bi = 128, 128
            full = np.repeat(np.repeat(s, bo, axis=-2), bi, axis=-1)
            a = a * full[..., :a.shape[-2], :a.shape[-1]]
        w[name_t] = a
    return w


class Reference:
    def __init__(self, directory):
        with open(os.path.join(directory, "config.json")) as f:
            c = json.load(f)
        c = c.get("text_config", c)
        self.c = c
        self.w = ref_weights(directory)
        self.moe = {int(i) for i in str(c["moe_layers_enum"]).split(",")}

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.c["rms_norm_eps"]) * g

    def rope(self, x, pos):  # x [S, heads, D], rotate-half
        D = x.shape[-1]
        inv = self.c["rope_theta"] ** (-np.arange(0, D, 2) / D)
        ang = pos[:, None] * inv[None]
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    @staticmethod
    def mlp(x, g, u, d):
        a = x @ g.T
        return ((a / (1 + np.exp(-a))) * (x @ u.T)) @ d.T

    def forward(self, tokens):
        c, w = self.c, self.w
        S, nh, D = len(tokens), c["num_attention_heads"], c["head_dim"]
        pos = np.arange(S, dtype=np.float64)
        x = w["model.embed_tokens.weight"][np.asarray(tokens)]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q = self.rms(h @ w[p + "self_attn.q_proj.weight"].T, w[p + "self_attn.inter_norm.weight"])
            q = (q @ w[p + "self_attn.wq.weight"].T).reshape(S, nh, D)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(S, 1, D)
            v = h @ w[p + "self_attn.v_proj.weight"].T
            q, k = self.rope(q, pos), self.rope(k, pos)[:, 0]
            s = np.einsum("qhd,kd->hqk", q, k) * D ** -0.5
            s = np.where(np.tril(np.ones((S, S), bool))[None], s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("hqk,kd->qhd", pr, v).reshape(S, nh * D)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            if i in self.moe:
                logits = h @ w[p + "moe.gate.weight"].T
                probs = np.exp(logits - logits.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                y = self.mlp(h, *(w[p + f"share_expert.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
                G, U, Dn = (w[p + f"moe.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
                for t in range(S):
                    top = np.argsort(-probs[t], kind="stable")[:c["moe_top_k"]]
                    wts = probs[t, top]
                    if c.get("norm_expert_weight"):
                        wts = wts / wts.sum()
                    for e, we in zip(top, wts):
                        y[t] += we * self.mlp(h[t], G[e], U[e], Dn[e])
            else:
                y = self.mlp(h, *(w[p + f"mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
            x = x + y
        return self.rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T

    def greedy(self, prompt, n):
        toks = list(prompt)
        for _ in range(n):
            toks.append(int(np.argmax(self.forward(toks)[-1])))
        return toks[len(prompt):]


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------
CFG = preset("step3-tiny")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("step3"))
    make_random_checkpoint(d, CFG, seed=5, std=0.1)
    return d


def _load(path, dtype="float32", **kw):
    return moejax.load(path, dtype=dtype, max_model_len=128, max_num_seqs=4, progress=False, **kw)


@pytest.fixture(scope="module")
def model(ckpt):
    return _load(ckpt)


@pytest.fixture(scope="module")
def ref(ckpt):
    return Reference(ckpt)


def _ids(shape, seed=None):
    """Random token ids: fresh (the per-test seed) unless a test fixes ``seed``."""
    return np.random.default_rng(seed).integers(2, VOCAB, size=shape)


def _prompt(n, seed=None):
    return [int(t) for t in _ids(n, seed)]


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
def test_published_config_shapes():
    """The published Step3 config.json parses to its values (MoE layers 4-59, 48 experts top-3, softmax
    routing, rope theta), and the parameter tree has the published checkpoint's tensor shapes."""
    from moejax.models.registry import abstract_params, parse_model_config
    from moejax.models.step3 import Step3Config
    from moejax.weights.param_tree import flatten
    cfg = parse_model_config(preset("step3"))
    assert Step3Config.from_dict(preset("step3")) == cfg  # the registry picks the family's own parser
    assert cfg.kv_cache_dim == 512 and cfg.n_routed_experts == 48 and cfg.num_experts_per_tok == 3
    assert cfg.moe_layers == tuple(range(4, 60))
    assert [cfg.is_moe_layer(i) for i in (0, 3, 4, 59, 60)] == [False, False, True, True, False]
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.routed_scaling_factor) == \
        ("softmax", "greedy", False, 1.0)
    assert cfg.rope.theta == 500000.0 and not cfg.rope.interleave and cfg.max_position_embeddings == 65536
    p = flatten(abstract_params(cfg, "bfloat16"))
    assert p[("layers_4", "self_attn", "q_proj", "weight")].shape == (2048, 7168)
    assert p[("layers_4", "self_attn", "k_proj", "weight")].shape == (256, 7168)
    assert p[("layers_4", "self_attn", "wq", "weight")].shape == (16384, 2048)
    assert p[("layers_4", "self_attn", "o_proj", "weight")].shape == (7168, 16384)
    assert p[("layers_4", "mlp", "gate", "weight")].shape == (48, 7168)
    assert p[("layers_4", "mlp", "experts", "gate_proj")].shape == (48, 7168, 5120)
    assert p[("layers_4", "mlp", "experts", "down_proj")].shape == (48, 5120, 7168)
    assert p[("layers_4", "share_expert", "up_proj", "weight")].shape == (5120, 7168)
    assert p[("layers_60", "mlp", "gate_proj", "weight")].shape == (18432, 7168)
    assert p[("lm_head", "weight")].shape == (128815, 7168)


def test_vl_config_and_list_moe_layers():
    """A step3_vl config parses from its text_config (moe_layers_enum as a list, sorted), the top-level
    eos ids taking over."""
    from moejax.models.registry import parse_model_config
    text = preset("step3-tiny", moe_layers_enum=[2, 1])
    text.pop("eos_token_id")
    vl = {"model_type": "step3_vl", "architectures": ["Step3VLForConditionalGeneration"], "text_config": text,
          "vision_config": {"hidden_size": 8}, "understand_projector_stride": 2, "projector_bias": False,
          "image_token_id": 7, "eos_token_id": [1, 2]}
    cfg = parse_model_config(vl)
    assert cfg.model_type == "step3_vl" and cfg.moe_layers == (1, 2) and cfg.eos_token_ids == (1, 2)


@pytest.mark.parametrize("change,needle", [
    ({"sliding_window": 4}, "sliding_window"),
    ({"moe_layers_enum": "1,9"}, "moe_layers_enum"),
    ({"moe_layers_enum": "1,x"}, "moe_layers_enum"),
    ({"moe_layers_enum": None}, "moe_layers_enum"),
    ({"num_attention_groups": 3}, "num_attention_groups"),
    ({"share_q_dim": 0}, "share_q_dim"),
    ({"moe_top_k": 17}, "moe_top_k"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_bad_configs_are_named(change, needle):
    """Invariant: an unsupported or invalid Step3 field is refused with an error naming it."""
    from moejax.models.registry import parse_model_config
    with pytest.raises(ValueError, match=needle):
        parse_model_config({**CFG, **change})


def test_bad_vl_configs_are_named():
    """Invariant: a bad step3_vl config is refused with an error naming the field (text_config.* inside)."""
    from moejax.models.registry import parse_model_config
    with pytest.raises(ValueError, match="text_config"):
        parse_model_config({"model_type": "step3_vl", "vision_config": {}})
    with pytest.raises(ValueError, match="text_config.share_q_dim"):
        parse_model_config({"model_type": "step3_vl", "text_config": {**CFG, "share_q_dim": -1}})
    with pytest.raises(ValueError, match="mystery"):
        parse_model_config({"model_type": "step3_vl", "text_config": CFG, "mystery": 1})


# ----------------------------------------------------------------------------------------------
# Numerics against the reference
# ----------------------------------------------------------------------------------------------
def test_score_matches_reference_float32(model, ref):
    """float32 prefill logits against the independent float64 NumPy reference: rel 1e-4."""
    ids = _ids((2, 23))
    got = model.score(ids)
    for b in range(2):
        assert rel_err(got[b], ref.forward(ids[b])) < 1e-4


def test_score_matches_reference_bfloat16(tmp_path):
    """bfloat16 prefill logits (bf16 checkpoint) against the float64 NumPy reference: rel 2e-2."""
    make_random_checkpoint(str(tmp_path), CFG, seed=6, dtype="bfloat16")
    m, r = _load(str(tmp_path), dtype="bfloat16"), Reference(str(tmp_path))
    ids = _ids((2, 17))
    got = m.score(ids)
    for b in range(2):
        assert rel_err(got[b], r.forward(ids[b])) < 2e-2


def test_greedy_generate_matches_reference_and_decode_matches_prefill(model, ref):
    """32 greedy tokens against the float64 reference's greedy loop; their decode-step logprobs
    against the log-softmax of one prefill over the whole sequence (atol 2e-4)."""
    # Fixed prompts: float32 against float64 over 32 greedy steps, where a near-tie could flip a token.
    prompts = [_prompt(5, seed=3), _prompt(13, seed=4), _prompt(2, seed=5)]
    out = moejax.generate(model, prompts, max_new_tokens=32, ignore_eos=True, logprobs=True)
    for p, o in zip(prompts, out):
        assert o.token_ids == ref.greedy(p, 32)
        # decode == prefill: the logprobs of the generated tokens (decode steps, paged cache) against
        # the score of the whole sequence (one prefill).
        full = np.asarray(p + o.token_ids[:-1])
        logits = model.score(full[None])[0, len(p) - 1:].astype(np.float64)
        lsm = logits - logits.max(-1, keepdims=True)
        lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
        want = lsm[np.arange(32), o.token_ids]
        np.testing.assert_allclose(o.logprobs, want, atol=2e-4)


def test_pallas_mfa_decode_matches_reference(ckpt, model, ref, monkeypatch):
    """The decode steps through the Pallas kernels (interpret mode on CPU; MFA through the pages
    kernel with values at column D): the same greedy tokens as the float64 reference."""
    traced = []
    real = mfa_decode.paged_decode_attention
    monkeypatch.setattr(mfa_decode, "paged_decode_attention", lambda *a, **kw: traced.append(kw) or real(*a, **kw))
    m = _load(ckpt, kernels="pallas")
    prompts = [_prompt(7, seed=6), _prompt(3, seed=7)]  # fixed, as in the greedy test above
    out = moejax.generate(m, prompts, max_new_tokens=6, ignore_eos=True, logprobs=True)
    base = moejax.generate(model, prompts, max_new_tokens=6, ignore_eos=True, logprobs=True)
    for p, o, b in zip(prompts, out, base):
        assert o.token_ids == ref.greedy(p, 6) == b.token_ids
        np.testing.assert_allclose(o.logprobs, b.logprobs, atol=2e-3)
    assert traced and all(kw["v_offset"] == CFG["head_dim"] for kw in traced)  # the kernel ran


def test_fp8_checkpoint_dequantised_on_load(tmp_path):
    """A block-scaled FP8 checkpoint (experts' per-expert scales, wq's 128-blocks): logits against the
    float64 reference's own dequantisation (rel 1e-4)."""
    from moejax.weights.safetensors_io import SafetensorsFile
    make_random_checkpoint(str(tmp_path), CFG, seed=7, std=0.1, fp8=True)
    f = SafetensorsFile(os.path.join(tmp_path, "model.safetensors"))
    assert str(f.get("model.layers.1.moe.up_proj.weight").dtype) == "float8_e4m3fn"
    assert f.get("model.layers.1.moe.up_proj.weight_scale_inv").shape == (16, 1, 1)
    assert str(f.get("model.layers.0.self_attn.wq.weight").dtype) == "float8_e4m3fn"
    ids = _ids((1, 11))
    assert rel_err(_load(str(tmp_path)).score(ids)[0], Reference(str(tmp_path)).forward(ids[0])) < 1e-4


def test_decode_attention_reads_the_cache_once():
    """One gather of the sequence's rows for all heads (counted in the jaxpr); the output against
    float64 NumPy per-head attention (rtol 1e-5)."""
    from moejax.layers.paged_attention import mfa_decode_attention
    rng = np.random.default_rng()
    B, nh, D, bs, nb, slots = 3, 8, 16, 4, 3, 64
    q = rng.standard_normal((B, nh, D)).astype(np.float32)
    cache = rng.standard_normal((slots, 2 * D)).astype(np.float32)
    tables = rng.permutation(slots // bs)[:B * nb].reshape(B, nb).astype(np.int32)
    lens = np.array([5, 12, 1], np.int32)
    fn = lambda q, c: mfa_decode_attention(q, c, tables, lens, bs, D ** -0.5, 1)  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(q, cache)
    reads = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "gather"
             and tuple(e.invars[0].aval.shape) == cache.shape]
    assert len(reads) == 1
    got = np.asarray(fn(q, cache))
    for b in range(B):
        rows = (tables[b][:, None] * bs + np.arange(bs)).reshape(-1)[:lens[b]]
        k, v = cache[rows, :D].astype(np.float64), cache[rows, D:].astype(np.float64)
        for h in range(nh):
            s = k @ q[b, h] * D ** -0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[b, h], p @ v / p.sum(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Expert parallelism
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")
@pytest.mark.parametrize("layout", ["dp8-ep8", "dp4-ep4"])
def test_ep_mesh_matches_single_device(ckpt, model, layout):
    """DP + EP on the mesh against the one-device model: prefill logits (rel 1e-5) and 8 greedy tokens."""
    ep = _load(ckpt, parallel=layout)
    ids = _ids((8, 14))
    assert rel_err(ep.score(ids), model.score(ids)) < 1e-5
    prompts = [_prompt(3 + 2 * i, seed=10 + i) for i in range(5)]  # fixed: greedy tokens compared exactly
    want = [o.token_ids for o in moejax.generate(model, prompts, max_new_tokens=8, ignore_eos=True)]
    assert [o.token_ids for o in moejax.generate(ep, prompts, max_new_tokens=8, ignore_eos=True)] == want


# ----------------------------------------------------------------------------------------------
# Checkpoint layouts and named errors
# ----------------------------------------------------------------------------------------------
def _tensors(d):
    from moejax.weights.safetensors_io import SafetensorsFile
    f = SafetensorsFile(os.path.join(d, "model.safetensors"))
    return {k: np.array(f.get(k)) for k in f.keys()}


def _rewrite(src, dst, fn, config=None):
    from moejax.tiny.checkpoint import write_checkpoint
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    write_checkpoint(str(dst), config or cfg, fn(_tensors(src)))
    return str(dst)


def test_vl_checkpoints_load(ckpt, model, tmp_path):
    """Step3-VL checkpoints in all three name layouts (language_model.*, model.language_model.*, no
    prefix; vision tensors skipped) give exactly the text checkpoint's logits."""
    ids = _ids((1, 9))
    want = model.score(ids)
    vl_cfg = {"model_type": "step3_vl", "architectures": ["Step3VLForConditionalGeneration"], "text_config": CFG,
              "vision_config": {"hidden_size": 8}, "image_token_id": 7}
    # Written by the tiny writer: text weights under language_model., plus vision-tower tensors.
    make_random_checkpoint(str(tmp_path / "vl"), vl_cfg, seed=5, std=0.1)
    names = set(_tensors(str(tmp_path / "vl")))
    assert "language_model.model.layers.1.moe.gate.weight" in names and "vit_downsampler.weight" in names
    np.testing.assert_array_equal(_load(str(tmp_path / "vl")).score(ids), want)
    # transformers-v5 style (model.language_model.*) and published style (no prefix) with vision tensors.
    vision = {"model.vision_model.embeddings.patch_embedding.weight": np.zeros((4, 3, 2, 2), np.float32),
              "vit_large_projector.weight": np.zeros((8, 4), np.float32)}
    for name, rename in [("v5", lambda k: k.replace("model.", "model.language_model.", 1)), ("plain", lambda k: k)]:
        d = _rewrite(ckpt, tmp_path / name, lambda t: {**{rename(k): v for k, v in t.items()}, **vision}, vl_cfg)
        np.testing.assert_array_equal(_load(d).score(ids), want)


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("model.layers.2.share_expert.down_proj.weight"), "model.layers.2.share_expert.down_proj.weight"),
    (lambda t: t.pop("model.layers.1.moe.gate_proj.weight"), "model.layers.1.moe.gate_proj.weight"),
    (lambda t: t.update({"model.layers.1.moe.up_proj.weight": np.zeros((16, 32, 32), np.float32)}),
     r"model.layers.1.moe.up_proj.weight.*shape"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}),
     r"model.layers.0.self_attn.k_proj.weight.*shape"),
    (lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight": np.zeros((32, 64), np.float32)}),
     "model.layers.1.mlp.experts.0.gate_proj.weight"),
    (lambda t: t.update({"model.layers.0.moe.gate.weight": np.zeros((16, 64), np.float32)}),
     "model.layers.0.moe.gate.weight"),
    (lambda t: t.update({"language_model.model.norm.weight": t["model.norm.weight"]}), "same parameter"),
    (lambda t: t.update({"model.layers.0.self_attn.wq.weight": t["model.layers.0.self_attn.wq.weight"].astype(
        ml_dtypes.float8_e4m3fn)}), "wq.weight_scale_inv"),
    (lambda t: t.update({"model.norm.weight_scale_inv": np.ones((1, 1), np.float32)}), "model.norm.weight_scale_inv"),
])
def test_bad_tensors_are_named(ckpt, tmp_path, edit, needle):
    """Invariant: a missing, misshapen, foreign, duplicate or unscaled tensor is refused with an error naming it."""
    def fn(t):
        edit(t)
        return t
    d = _rewrite(ckpt, tmp_path / "bad", fn)
    with pytest.raises(ValueError, match=needle):
        _load(d)


def test_make_tiny_checkpoint_script(tmp_path):
    """scripts/make_tiny_checkpoint.py writes a Step3 FP8 bf16 checkpoint whose logits match the float64
    reference read from it (rel 2e-2, the bf16 bound); --via transformers is refused for Step3."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "make_tiny_checkpoint", os.path.join(os.path.dirname(__file__), "..", "scripts", "make_tiny_checkpoint.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(tmp_path / "a"), "--preset", "step3-tiny", "--via", "numpy", "--fp8", "--dtype", "bfloat16"])
    got = _load(str(tmp_path / "a"), dtype="bfloat16").score([[3, 4, 5]])
    assert got.shape == (1, 3, VOCAB)
    assert rel_err(got[0], Reference(str(tmp_path / "a")).forward([3, 4, 5])) < 2e-2
    with pytest.raises(SystemExit):
        script.main([str(tmp_path / "b"), "--preset", "step3-tiny", "--via", "transformers"])
    from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
    with pytest.raises(ValueError, match="step3"):
        make_hf_checkpoint(str(tmp_path / "c"), preset("step3-tiny"))


def test_step3_served_over_openai_api(tmp_path):
    """scripts/serve.py's server serves a Step3 checkpoint as it does DeepSeek: greedy chat and
    completions equal moejax.generate."""
    import openai
    from moejax.server.app import ServerThread
    from moejax.tiny.checkpoint import make_random_checkpoint
    from moejax.tiny.presets import preset
    path = make_random_checkpoint(str(tmp_path / "s3"), preset("step3-tiny"), seed=5, std=0.1)
    load = lambda: moejax.load(path, dtype="float32", max_model_len=128, max_num_seqs=8, progress=False)  # noqa: E731
    srv = ServerThread(load(), model_name="step3-tiny").start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        ids = np.random.default_rng().integers(2, 300, size=9).tolist()
        want = moejax.generate(load(), [ids], max_new_tokens=12, ignore_eos=True)[0]
        r = client.completions.create(model="step3-tiny", prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text and r.usage.completion_tokens == 12
        messages = [{"role": "user", "content": "hi"}]
        chunks = list(client.chat.completions.create(model="step3-tiny", messages=messages, max_tokens=5,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        m = load()
        chat_ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        assert text == moejax.generate(m, [chat_ids], max_new_tokens=5, ignore_eos=True)[0].text
        assert chunks[-1].usage.completion_tokens == 5
    finally:
        srv.stop()
