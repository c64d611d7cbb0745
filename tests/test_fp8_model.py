"""FP8 block-scaled weights end to end (issue 16), on tiny checkpoints with the real 128x128 block
layout and sizes that cut blocks at the edge (hidden 200, experts 160, dense 300).

References: the same checkpoint loaded with ``weight_dtype="bf16"`` (dequantised on load, today's
path), in float32 and bfloat16; a one-device run for expert parallelism; the model before an EPLB
rebalance. Kernel-level tests (Pallas interpret mode vs NumPy) are in test_fp8_kernels.py.
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest

import moejax
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset
from moejax.weights.param_tree import flatten

CFG = preset("v3-tiny", hidden_size=200, moe_intermediate_size=160, intermediate_size=300,
             n_routed_experts=16, num_experts_per_tok=4)
STEP3 = preset("step3-tiny", hidden_size=200, moe_intermediate_size=160, intermediate_size=300, share_expert_dim=144)
# W8A8 quantises every GEMM input to e4m3 (3 mantissa bits, ~3% rounding per element). On these random
# weights its logits sit ~10% (relative) from the bf16 model, 10x the bf16-vs-f32 spread (~1%); the
# bound is set at twice what was measured (tests print the figures).
W8A8_BOUND = 0.2


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def token_rel(a, b):
    """Median over tokens of each token's relative logit error."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.median(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: make_random_checkpoint(str(tmp_path_factory.mktemp(name)), cfg, seed=3, fp8=True)
            for name, cfg in (("v3", CFG), ("step3", STEP3))}


_MODELS: dict = {}


def _load(path, **kw):
    """A loaded model; one-device ones are shared between tests (scoring and generating leave them
    as they were: the engine ends idle), which saves each test its compilations."""
    key = (path, tuple(sorted(kw.items())))
    if "parallel" in kw:
        return moejax.load(path, max_model_len=128, max_num_seqs=8, progress=False, **{"dtype": "float32", **kw})
    if key not in _MODELS:
        _MODELS[key] = moejax.load(path, max_model_len=128, max_num_seqs=8, progress=False,
                                   **{"dtype": "float32", **kw})
    return _MODELS[key]


@pytest.mark.parametrize("name", ["v3", "step3"])
def test_fp8_stays_fp8_on_device_with_its_scales(ckpts, name):
    """Checked against the checkpoint: every projection the policy names is float8_e4m3fn on the device
    with its float32 block scales beside it, equal to the file's bytes (experts stacked in HF's
    [E, out, in] layout); kv_b_proj, norms, router and lm_head keep the model dtype."""
    from moejax.weights.safetensors_io import CheckpointReader
    m = _load(ckpts[name])
    flat = flatten(m.params)
    fp8 = {p for p, a in flat.items() if a.dtype == ml_dtypes.float8_e4m3fn}
    assert fp8 and all(p[:-1] + (p[-1] + "_scale_inv",) in flat for p in fp8)
    assert not any("kv_b_proj" in p or "lm_head" in p or "norm" in p[-2] for p in fp8)
    files = CheckpointReader(ckpts[name])
    if name == "v3":
        w = files.get("model.layers.1.mlp.experts.5.gate_proj.weight")
        s = files.get("model.layers.1.mlp.experts.5.gate_proj.weight_scale_inv")
        got = np.asarray(flat["layers_1", "mlp", "experts", "gate_proj"][5])
        got_s = np.asarray(flat["layers_1", "mlp", "experts", "gate_proj_scale_inv"][5])
        assert np.array_equal(got.view(np.uint8), np.asarray(w).view(np.uint8)) and np.array_equal(got_s, s)
        w = files.get("model.layers.0.self_attn.o_proj.weight")
        got = np.asarray(flat["layers_0", "self_attn", "o_proj", "weight"])
        assert np.array_equal(got.view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("name", ["v3", "step3"])
def test_w8a16_logits_and_greedy_equal_the_dequantised_model(ckpts, name):
    """Reference: the same checkpoint dequantised on load (weight_dtype="bf16"). float32: the W8A16
    path computes the same function (its XLA fallback dequantises per block, then multiplies), so
    logits agree to rounding and greedy tokens agree over 32 steps. bfloat16: within bf16 rounding
    of the float32 reference (relative error under 3e-2, see the assertion)."""
    rng = np.random.default_rng()
    ids = rng.integers(2, 320, size=(2, 19))
    prompts = [rng.integers(2, 320, size=n).tolist() for n in (5, 11)]
    fp8, deq = _load(ckpts[name]), _load(ckpts[name], weight_dtype="bf16")
    assert fp8.config.fp8.enabled and not deq.config.fp8.enabled
    assert rel(fp8.score(ids), deq.score(ids)) < 1e-5
    kw = dict(max_new_tokens=32, ignore_eos=True)
    assert [r.token_ids for r in moejax.generate(fp8, prompts, **kw)] == \
        [r.token_ids for r in moejax.generate(deq, prompts, **kw)]
    ref = deq.score(ids)  # float32, dequantised
    b_fp8, b_deq = _load(ckpts[name], dtype="bfloat16"), _load(ckpts[name], dtype="bfloat16", weight_dtype="bf16")
    err, spread = token_rel(b_fp8.score(ids), ref), token_rel(b_deq.score(ids), ref)
    print(f"{name}: bf16 logits vs the float32 reference, median over tokens: W8A16 {err:.4f}, "
          f"dequantised bf16 {spread:.4f}")
    # "Within bf16 rounding": the typical token under 2e-2 (measured ~1e-2 for both bf16 models). The
    # median, not the norm over all tokens: in bf16 a few tokens' routing near-ties flip (a different
    # expert, 20-50% off for that token), in either model at its own tokens, and those dominated the
    # whole-tensor norm (0.035 vs 0.010 for the same weights, seed 1403939003). The absolute bound is 3e-2:
    # seed 3793257830 gave 0.0214 for v3 (the same before and after the kernels moved); the bound that
    # compares the two models is the second.
    assert err < 3e-2 and err < 1.5 * spread + 2e-3


def test_w8a8_error_and_greedy_agreement_are_bounded(ckpts):
    """Reference: the dequantised bf16 model and the float32 one. W8A8's relative logit error is
    measured and bounded by W8A8_BOUND (see the module's note); greedy agreement over 24 steps is
    measured (the fraction of steps before the first differing token is printed)."""
    rng = np.random.default_rng()
    ids = rng.integers(2, 320, size=(6, 19))  # more tokens: a steadier relative error
    a8 = _load(ckpts["v3"], dtype="bfloat16", fp8_variant="w8a8")
    b16 = _load(ckpts["v3"], dtype="bfloat16", weight_dtype="bf16")
    f32 = _load(ckpts["v3"], weight_dtype="bf16")
    err, spread = rel(a8.score(ids), b16.score(ids)), rel(b16.score(ids), f32.score(ids))
    prompt = rng.integers(2, 320, size=9).tolist()
    got = moejax.generate(a8, [prompt], max_new_tokens=24, ignore_eos=True)[0].token_ids
    want = moejax.generate(b16, [prompt], max_new_tokens=24, ignore_eos=True)[0].token_ids
    agree = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), 24)
    print(f"W8A8 vs bf16: relative logit error {err:.4f} (bf16 vs f32: {spread:.4f}); "
          f"greedy agrees for {agree}/24 steps")
    assert err < W8A8_BOUND


def test_fp8_quantised_on_load_from_a_bf16_checkpoint(tmp_path):
    """weight_dtype="fp8" on a bf16 checkpoint (vllm --quantization fp8): the loaded FP8 weights and
    scales equal quantize_block_fp8 of the file's weights (the NumPy reference, bit for bit). Its
    distance from the unquantised model is printed (FP8 weight rounding: 0.07-0.16 relative on these
    random weights, draw to draw) and only sanity-bounded."""
    from moejax.weights.fp8 import quantize_block_fp8
    from moejax.weights.safetensors_io import CheckpointReader
    d = make_random_checkpoint(str(tmp_path / "bf16"), CFG, seed=4)
    m, ref = _load(d, weight_dtype="fp8"), _load(d)
    w = np.asarray(CheckpointReader(d).get("model.layers.2.self_attn.q_b_proj.weight"))
    q, s = quantize_block_fp8(w)
    got = flatten(m.params)
    assert np.array_equal(np.asarray(got["layers_2", "self_attn", "q_b_proj", "weight"]).view(np.uint8), q.view(np.uint8))
    assert np.array_equal(np.asarray(got["layers_2", "self_attn", "q_b_proj", "weight_scale_inv"]), s)
    ids = np.random.default_rng().integers(2, 320, size=(4, 13))
    err = rel(m.score(ids), ref.score(ids))
    print(f"FP8 quantised on load vs the bf16 checkpoint: relative logit error {err:.4f}")
    assert err < 0.5


def test_fp8_layers_policy_and_bad_arguments(ckpts):
    """The per-layer-type policy: only the named types stay FP8; bad values name the argument."""
    m = _load(ckpts["v3"], fp8_layers="experts")
    kinds = {p[1:3] for p, a in flatten(m.params).items() if a.dtype == ml_dtypes.float8_e4m3fn}
    assert kinds == {("mlp", "experts")}
    for kw, needle in (({"weight_dtype": "int4"}, "weight_dtype"), ({"fp8_layers": "experts,bogus"}, "fp8_layers"),
                       ({"fp8_variant": "w4a8"}, "fp8_variant")):
        with pytest.raises(ValueError, match=needle):
            _load(ckpts["v3"], **kw)


def test_fp8_save_load_round_trip(ckpts, tmp_path):
    """moejax.save/load (orbax) keeps FP8 weights and scales bit for bit; the reloaded model scores
    the same logits; loading it with another FP8 policy is refused by name."""
    m = _load(ckpts["v3"])
    moejax.save(m, str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "moejax.json").read_text())["fp8_layers"]
    back = _load(str(tmp_path / "saved"))
    got = flatten(back.params)  # by path: the two trees' key orders are not a contract
    assert got.keys() == flatten(m.params).keys()
    for p, a in flatten(m.params).items():
        b = got[p]
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), p
    ids = np.random.default_rng().integers(2, 320, size=(2, 11))
    np.testing.assert_array_equal(back.score(ids), m.score(ids))
    with pytest.raises(ValueError, match="fp8_layers"):
        _load(str(tmp_path / "saved"), weight_dtype="bf16")


# Re-blocking (issue 31) rounds every element once more, to e4m3 at its 128x128 block's scale
# S = block max / 448: at most half an ulp, i.e. |W|/16 for normal values (3 mantissa bits) and
# 16 S = block max / 28 in all (the top binade [256, 448] has ulp 32; subnormals add 2^-10 S). So
# ||W' - W||_F / ||W||_F <= 1/16 and max|W' - W| / max|W| <= 1/28 (the block max <= the matrix max).
# Random normal weights come near the second (measured 0.0357 of 1/28 = 0.0357) and at ~0.027 of the
# first. 1e-6: float32 rounding of the measurement.
REBLOCK_FRO_BOUND, REBLOCK_MAX_BOUND = 1 / 16 + 1e-6, 1 / 28 + 1e-6


def _device_vs_file_error(params, directory, block, hf_name, path, expert=None):
    """An independent measurement of one matrix: the device's FP8 weight and 128x128 scales dequantised
    against the checkpoint's weight dequantised with its own blocks: (rel Frobenius, rel max abs)."""
    from moejax.weights.fp8 import dequantize_block_fp8
    from moejax.weights.safetensors_io import CheckpointReader
    files = CheckpointReader(directory)
    flat = flatten(params)
    scale_path = path[:-1] + (path[-1] + "_scale_inv",)
    w, s = np.asarray(flat[path]), np.asarray(flat[scale_path])
    if expert is not None:
        w, s = w[expert], s[expert]
    assert w.dtype == ml_dtypes.float8_e4m3fn and s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    ref = dequantize_block_fp8(np.asarray(files.get(hf_name)), np.asarray(files.get(hf_name + "_scale_inv")), block)
    d = dequantize_block_fp8(w, s, (128, 128)) - ref
    return float(np.linalg.norm(d) / np.linalg.norm(ref)), float(np.abs(d).max() / np.abs(ref).max())


def test_fp8_checkpoint_with_32x32_blocks_stays_fp8_reblocked(ckpts, tmp_path, capsys):
    """Issue 31: a DeepSeek-V3 FP8 checkpoint with 32x32 blocks, weight_dtype="auto", stays FP8 on the
    device (re-blocked to the kernels' 128x128): float8_e4m3fn leaves, params ~half the bytes of the
    same checkpoint dequantised to bf16. The load warns (UserWarning + a stderr line) with the measured
    error, which model.fp8_reblock_error records, which is within the half-ulp bounds above, and which
    an independent measurement of two matrices (device vs file) does not exceed. Logits (float32, fresh
    ids) against the same checkpoint loaded with weight_dtype="bf16" (exact): the median token's
    relative error is under 1.5x what the checkpoint's own FP8 quantisation costs against its float
    source (re-blocking is one more e4m3 rounding of the same size: measured 0.050-0.057 against
    0.058-0.065 over 5 draws, seed 3 weights) and under 0.1 (about twice what was measured)."""
    d = make_random_checkpoint(str(tmp_path / "b32"), CFG, seed=3, fp8=True, fp8_block=(32, 32))
    src = make_random_checkpoint(str(tmp_path / "src"), CFG, seed=3)  # the float weights it was quantised from
    assert json.loads((tmp_path / "b32" / "config.json").read_text())["quantization_config"]["weight_block_size"] \
        == [32, 32]
    with pytest.warns(UserWarning, match=r"32x32 weight blocks.*re-blocked to 128x128") as rec:
        m8 = _load(d, dtype="bfloat16")
    msgs = [str(w.message) for w in rec if "re-blocked" in str(w.message)]
    assert len(msgs) == 1  # once a load
    e = m8.fp8_reblock_error
    assert e["checkpoint_block"] == [32, 32] and e["device_block"] == [128, 128] and e["matrices"] > 0
    assert f"{e['rel_frobenius']:.3e}" in msgs[0] and f"{e['rel_max_abs']:.3e}" in msgs[0]
    assert "re-blocked to 128x128" in capsys.readouterr().err
    print(f"re-blocking 32x32 -> 128x128: {e['matrices']} matrices, max relative Frobenius error "
          f"{e['rel_frobenius']:.4e}, max abs error / max abs {e['rel_max_abs']:.4e}")
    assert 0 < e["rel_frobenius"] <= REBLOCK_FRO_BOUND and 0 < e["rel_max_abs"] <= REBLOCK_MAX_BOUND
    for hf_name, path, expert in (("model.layers.0.self_attn.o_proj.weight", ("layers_0", "self_attn", "o_proj",
                                                                               "weight"), None),
                                  ("model.layers.1.mlp.experts.5.down_proj.weight",
                                   ("layers_1", "mlp", "experts", "down_proj"), 5)):
        fro, mx = _device_vs_file_error(m8.params, d, (32, 32), hf_name, path, expert)
        assert 0 < fro <= e["rel_frobenius"] + 1e-7 and 0 < mx <= e["rel_max_abs"] + 1e-7, hf_name
    # Bytes: the FP8 load against the same checkpoint dequantised to bf16.
    b16 = _load(d, dtype="bfloat16", weight_dtype="bf16")
    assert b16.fp8_reblock_error is None
    fp8_leaves = [p for p, a in flatten(m8.params).items() if a.dtype == ml_dtypes.float8_e4m3fn]
    assert fp8_leaves and not any(a.dtype == ml_dtypes.float8_e4m3fn for a in flatten(b16.params).values())
    nbytes = lambda m: sum(a.size * a.dtype.itemsize for a in flatten(m.params).values())  # noqa: E731
    ratio = nbytes(m8) / nbytes(b16)
    print(f"param bytes: FP8 re-blocked {nbytes(m8)}, bf16 {nbytes(b16)} ({ratio:.3f}x)")
    # Not all of it is FP8 (embedding, lm_head, kv_b_proj, norms, float32 router): 0.52x measured.
    assert 0.45 < ratio < 0.6
    moejax.save(m8, str(tmp_path / "saved"))  # the saved (re-blocked) weights keep the record
    assert _load(str(tmp_path / "saved"), dtype="bfloat16").fp8_reblock_error == e
    # Logits, float32.
    with pytest.warns(UserWarning, match="re-blocked"):
        f8 = _load(d)
    deq, ref = _load(d, weight_dtype="bf16"), _load(src)
    ids = np.random.default_rng().integers(2, 320, size=(6, 19))
    want = deq.score(ids)
    err, spread = token_rel(f8.score(ids), want), token_rel(want, ref.score(ids))
    print(f"logits, median token relative error: re-blocked vs the checkpoint {err:.4f}; "
          f"the checkpoint vs its float source {spread:.4f}")
    assert err < 1.5 * spread and err < 0.1
    assert _load(ckpts["v3"]).fp8_reblock_error is None  # a 128x128 checkpoint: kept as it is


@pytest.mark.parametrize("name,block", [("v3", (48, 96)), ("v3", (256, 256)), ("v3", (1, 128)),
                                        ("step3", (32, 32))])
def test_any_checkpoint_block_is_reblocked_to_128(tmp_path, name, block):
    """Blocks that do not divide 128 (48x96), are larger (256x256) or one row high (1x128), and Step3's
    experts stacked on disk ([E, out, in], scales [E, rows, cols]): the loader (no engine) gives float8
    leaves with 128x128 scales only, warns once, and the measured error is within the half-ulp bounds."""
    from moejax.layers.fp8_policy import Fp8Policy
    from moejax.models.registry import abstract_params, family_of, parse_model_config
    from moejax.weights.fp8 import ReblockStats
    from moejax.weights.loader import load_hf_params
    hf = {"v3": CFG, "step3": STEP3}[name]
    d = make_random_checkpoint(str(tmp_path / "ck"), hf, seed=5, fp8=True, fp8_block=block)
    cfg = parse_model_config(json.loads((tmp_path / "ck" / "config.json").read_text()))
    assert cfg.fp8_block_size == block
    stats = ReblockStats()
    with pytest.warns(UserWarning, match=rf"{block[0]}x{block[1]} weight blocks.*re-blocked to 128x128"):
        abstract = abstract_params(cfg, "bfloat16", Fp8Policy.create("default"))
        flat = flatten(load_hf_params(d, cfg, family_of(cfg), abstract, progress=False, reblock=stats))
    fp8 = [p for p, a in flat.items() if a.dtype == ml_dtypes.float8_e4m3fn]
    assert fp8
    for p in fp8:
        w, s = flat[p], flat[p[:-1] + (p[-1] + "_scale_inv",)]
        assert s.shape[-2:] == (-(-w.shape[-2] // 128), -(-w.shape[-1] // 128)), p
    e = stats.summary()
    print(f"{name} {block}: {e}")
    assert e["checkpoint_block"] == list(block) and e["device_block"] == [128, 128]
    assert 0 < e["rel_frobenius"] <= REBLOCK_FRO_BOUND and 0 < e["rel_max_abs"] <= REBLOCK_MAX_BOUND


def ep_close(got, want, tol=1e-5) -> bool:
    """EP against one device, float32: every sequence's logits within ``tol`` (relative, per token)
    but at most one. Summation order differs between the layouts, so a router near-tie can pick
    another expert for one token (seed 127822787: one token 19% off, the other 119 under 7e-7), which
    also moves that sequence's later tokens; a sharding or scale error moves every sequence."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tok = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    bad = (tok > tol).any(axis=1)
    print(f"EP vs one device: per-token relative error median {np.median(tok):.1e}, sequences off: {bad.sum()}")
    return bool(bad.sum() <= 1)


needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")


@needs8
def test_fp8_expert_parallel_equals_one_device_and_rebalance_changes_nothing(ckpts, tmp_path):
    """EP exactness with FP8 (scales sharded with their experts): dp8-ep8 logits equal one device's;
    then an EPLB rebalance with replicas (weights and scales permuted together) keeps logits and
    greedy tokens, and moejax.save after it writes the logical experts back."""
    layout = tmp_path / "eplb.yaml"
    layout.write_text("data_parallel_size: 8\nexpert_parallel_size: 8\nnum_redundant_experts: 8\n")
    rng = np.random.default_rng()
    ids = rng.integers(2, 320, size=(8, 15))
    one = _load(ckpts["v3"])
    ep = _load(ckpts["v3"], parallel=str(layout))
    want = one.score(ids)
    assert ep_close(ep.score(ids), want)
    prompts = [rng.integers(2, 320, size=int(rng.integers(3, 12))).tolist() for _ in range(8)]
    kw = dict(max_new_tokens=8, ignore_eos=True)
    before = [r.token_ids for r in moejax.generate(ep, prompts, **kw)]
    ep.engine.balancer.rebalance(rng.integers(0, 1000, size=(len(ep.engine.balancer.names), 16)))
    assert ep_close(ep.score(ids), want)
    assert [r.token_ids for r in moejax.generate(ep, prompts, **kw)] == before
    moejax.save(ep, str(tmp_path / "after"))
    assert ep_close(_load(str(tmp_path / "after")).score(ids), want)


def test_plan_memory_counts_the_models_own_bytes(capsys):
    """scripts/plan_memory.py against an independent count of DeepSeek-V3's parameters: 671B in the
    main model as published, plus its MTP layer as built (12.5B: DeepSeek's 14B MTP module less its copy
    of the embedding, which the model shares: 685B in all as published), so bf16 is 2 bytes x ~683.6B;
    FP8 halves the FP8 layers (plus 1/16384 for scales); the KV cache holds 61 layers x 576 values x
    2 bytes a token (the MTP layer's cache rows are not allocated yet); dp8-ep8 splits only the experts."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("plan_memory", pathlib.Path(__file__).parent.parent / "scripts" /
                                                  "plan_memory.py")
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    hf = preset("deepseek-v3")
    one = pm.plan(hf, None, "bf16", 2000, 1.0, 0, "auto", 2000, 100)
    assert 2 * 683e9 < one["weights_gb"] * 1e9 < 2 * 684.5e9
    assert one["kv_bytes_per_token"] == 61 * 576 * 2
    ep_bf16 = pm.plan(hf, "dp8-ep8", "bf16", 2000, 1.0, 0, "auto", 2000, 100)
    ep = pm.plan(hf, "dp8-ep8", "fp8", 141, 0.9, 6, "auto", 2000, 100)
    assert abs(ep_bf16["weights_gb_by_kind"]["experts"] * 8 - one["weights_gb_by_kind"]["experts"]) < 1e-6
    assert ep_bf16["weights_gb_by_kind"]["embedding"] == one["weights_gb_by_kind"]["embedding"]
    ratio = ep["weights_gb_by_kind"]["experts"] / ep_bf16["weights_gb_by_kind"]["experts"]
    assert abs(ratio - 0.5 * (1 + 4 / 128 ** 2)) < 1e-3  # 1 byte a weight + a float32 scale per 128x128 block
    assert ep["fits"] and ep["kv_tokens_per_gpu"] * ep["kv_bytes_per_token"] <= ep["kv_gb"] * 1e9
    # A policy keeping attention in bf16: the same experts, attention at bf16's 2 bytes a weight.
    experts_only = pm.plan(hf, "dp8-ep8", "fp8", 141, 0.9, 6, "auto", 2000, 100, fp8_layers="experts,shared_experts")
    assert experts_only["fp8_layers"] == ["experts", "shared_experts"]
    assert experts_only["weights_gb_by_kind"]["experts"] == ep["weights_gb_by_kind"]["experts"]
    assert experts_only["weights_gb_by_kind"]["attention"] > 1.5 * ep["weights_gb_by_kind"]["attention"]
    assert experts_only["seqs_per_node"] < ep["seqs_per_node"]
    assert pm.main(["--preset", "deepseek-v3", "--weight-dtype", "fp8", "--gpu-memory", "141"]) in (0, 1)
    out = capsys.readouterr().out
    assert "weights per GPU" in out and "experts" in out and "largest that fits" in out
