import json

import jax
import numpy as np
import pytest

from moejax.config import EngineConfig
from moejax.engine.model_runner import HOST_CACHE_BYTES, STEP_RESERVE_BYTES, default_num_blocks
from moejax.engine.sample_controls import history_bytes
from moejax.kernels.kv_quant import cache_array_dtype, cache_row_dim
from moejax.models.registry import load_model_config, parse_model_config
from moejax.tiny.presets import preset


def test_v3_fields():
    """Parsed fields of the published DeepSeek-V3 config.json, against its values; the softmax
    scale against the analytic yarn value (192^-0.5 * mscale(40, 1.0)^2)."""
    c = parse_model_config(preset("deepseek-v3"))
    assert (c.q_lora_rank, c.kv_lora_rank, c.kv_cache_dim) == (1536, 512, 576)
    assert (c.scoring_func, c.topk_method, c.n_group, c.topk_group, c.num_experts_per_tok) == ("sigmoid", "noaux_tc", 8, 4, 8)
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5 and c.first_k_dense_replace == 3
    assert c.rope.type == "yarn" and c.rope.factor == 40 and c.rope.mscale_all_dim == 1.0
    # softmax scale carries mscale(40, 1.0)^2
    assert abs(c.softmax_scale - 192 ** -0.5 * (0.1 * __import__("math").log(40) + 1) ** 2) < 1e-12


def test_v2_lite_fields():
    """Parsed fields of the published DeepSeek-V2-Lite config.json, against its values."""
    c = parse_model_config(preset("deepseek-v2-lite"))
    assert c.q_lora_rank is None and c.scoring_func == "softmax" and c.topk_method == "greedy"
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (64, 6, 2, 1)
    assert not c.norm_topk_prob


def test_transformers_v5_rope_parameters_accepted():
    """transformers v5's rope_parameters (rope_theta inside) parse to the same config as the v4
    rope_scaling + rope_theta spelling of the same preset."""
    d = preset("v3-tiny")
    rs = d.pop("rope_scaling")
    d["rope_parameters"] = {**rs, "rope_type": "yarn", "rope_theta": d.pop("rope_theta")}
    c = parse_model_config(d)
    assert c.rope.type == "yarn" and c.rope.theta == 10000.0
    assert c == parse_model_config(preset("v3-tiny"))  # the whole config, rope included, as from rope_scaling


@pytest.mark.parametrize("field,value,needle", [
    ("model_type", "llama", "model_type"),
    ("some_new_field", 3, "some_new_field"),
    ("hidden_act", "gelu", "hidden_act"),
    ("scoring_func", "relu", "scoring_func"),
    ("topk_method", "random", "topk_method"),
    ("n_group", 3, "n_group"),
    ("topk_group", 9, "topk_group"),
    ("hidden_size", -4, "hidden_size"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config"),
])
def test_bad_fields_are_named(field, value, needle):
    """Invariant: an unsupported or invalid field is refused with an error naming the field."""
    d = preset("v3-tiny")
    d[field] = value
    with pytest.raises(ValueError, match=needle):
        parse_model_config(d)


def test_missing_field_named():
    """Invariant: a missing required field is refused with an error naming it."""
    d = preset("v2-lite-tiny")
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        parse_model_config(d)


def test_unsupported_rope_type_named():
    """Invariant: an unsupported rope_scaling type is refused with an error naming rope_scaling."""
    d = preset("v3-tiny")
    d["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        parse_model_config(d)


def test_from_file(tmp_path):
    """load_model_config on a directory gives the config parse_model_config gives for the same dict."""
    (tmp_path / "config.json").write_text(json.dumps(preset("v3-tiny")))
    c = load_model_config(str(tmp_path))
    assert c.model_type == "deepseek_v3" and c == parse_model_config(preset("v3-tiny"))


@pytest.mark.parametrize("kw", [
    {"gpu_memory_utilization": 0}, {"gpu_memory_utilization": -0.5}, {"gpu_memory_utilization": 1.01},
    {"gpu_memory_utilization": float("nan")}, {"gpu_memory_utilization": float("inf")},
    {"gpu_memory_utilization": True}, {"gpu_memory_utilization": "0.9"}, {"gpu_memory_utilization": 10**400},
    {"max_preemptions": -1}, {"max_preemptions": 1.5}, {"max_preemptions": True}, {"max_preemptions": None},
])
def test_engine_config_bad_capacity_knobs_named(kw):
    """Invariant: a bad cache-capacity knob is refused by EngineConfig.create with an error naming it."""
    cfg = parse_model_config(preset("v3-tiny"))
    with pytest.raises(ValueError, match=next(iter(kw))):
        EngineConfig.create(cfg, **kw)


class _FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_gpu_memory_utilization_sizes_the_cache(monkeypatch):
    """default_num_blocks on a device that reports its memory (a fake memory_stats): the cache gets
    (gpu_memory_utilization x bytes_limit - bytes_in_use - the step reserve) // block bytes, so a larger
    share gives more blocks; too little memory for one sequence names the knob; without a limit (CPU)
    the share changes nothing (the host default)."""
    cfg = parse_model_config(preset("v3-tiny"))
    rng = np.random.default_rng()
    u_lo, u_hi = float(rng.uniform(0.3, 0.6)), float(rng.uniform(0.7, 1.0))
    assert EngineConfig.create(cfg).cache.gpu_memory_utilization == 0.9  # vLLM's default
    assert EngineConfig.create(cfg, max_preemptions=0).scheduler.max_preemptions == 0
    confs = {u: EngineConfig.create(cfg, dtype="float32", max_model_len=2048, max_num_seqs=2**18,
                                    gpu_memory_utilization=u) for u in (u_lo, u_hi)}
    c = confs[u_lo]
    per_block = (cfg.num_hidden_layers * c.cache.block_size * cache_row_dim(cfg.kv_cache_dim, "auto")
                 * cache_array_dtype("auto", "float32", c.kernels).itemsize)
    limit = int(rng.integers(8, 200)) << 30
    in_use = int(rng.integers(0, limit // 4))
    stats = {"bytes_limit": limit, "bytes_in_use": in_use}
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeDevice(stats)])
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_FakeDevice(stats)])
    got = {u: default_num_blocks(conf) for u, conf in confs.items()}
    for u, n in got.items():
        assert n == (int(u * limit) - in_use - STEP_RESERVE_BYTES - history_bytes(2**18, cfg.vocab_size)) // per_block
    assert got[u_hi] > got[u_lo]
    stats["bytes_in_use"] = int(u_lo * limit) - STEP_RESERVE_BYTES - per_block  # room for less than a sequence
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        default_num_blocks(c)
    for host_stats in (None, {}):
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeDevice(host_stats)])
        monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_FakeDevice(host_stats)])
        assert {default_num_blocks(conf) for conf in confs.values()} == {HOST_CACHE_BYTES // per_block}
