import json

import pytest

from moejax.models.registry import load_model_config, parse_model_config
from moejax.tiny.presets import preset


def test_v3_fields():
    c = parse_model_config(preset("deepseek-v3"))
    assert (c.q_lora_rank, c.kv_lora_rank, c.kv_cache_dim) == (1536, 512, 576)
    assert (c.scoring_func, c.topk_method, c.n_group, c.topk_group, c.num_experts_per_tok) == ("sigmoid", "noaux_tc", 8, 4, 8)
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5 and c.first_k_dense_replace == 3
    assert c.rope.type == "yarn" and c.rope.factor == 40 and c.rope.mscale_all_dim == 1.0
    # softmax scale carries mscale(40, 1.0)^2
    assert abs(c.softmax_scale - 192 ** -0.5 * (0.1 * __import__("math").log(40) + 1) ** 2) < 1e-12


def test_v2_lite_fields():
    c = parse_model_config(preset("deepseek-v2-lite"))
    assert c.q_lora_rank is None and c.scoring_func == "softmax" and c.topk_method == "greedy"
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (64, 6, 2, 1)
    assert not c.norm_topk_prob


def test_transformers_v5_rope_parameters_accepted():
    d = preset("v3-tiny")
    rs = d.pop("rope_scaling")
    d["rope_parameters"] = {**rs, "rope_type": "yarn", "rope_theta": d.pop("rope_theta")}
    c = parse_model_config(d)
    assert c.rope.type == "yarn" and c.rope.theta == 10000.0


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
    d = preset("v3-tiny")
    d[field] = value
    with pytest.raises(ValueError, match=needle):
        parse_model_config(d)


def test_missing_field_named():
    d = preset("v2-lite-tiny")
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        parse_model_config(d)


def test_unsupported_rope_type_named():
    d = preset("v3-tiny")
    d["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        parse_model_config(d)


def test_from_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("v3-tiny")))
    assert load_model_config(str(tmp_path)).model_type == "deepseek_v3"
