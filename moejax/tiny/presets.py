"""HF config.json contents for tiny random models of each family (and the real shapes)."""

from __future__ import annotations

import copy

_V3_TINY = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "tie_word_embeddings": False,
    "attention_bias": False, "initializer_range": 0.02,
}

_V2_LITE_TINY = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 16, "num_experts_per_tok": 6, "n_shared_experts": 2, "topk_method": "greedy",
    "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
    "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "tie_word_embeddings": False,
    "attention_bias": False, "initializer_range": 0.02,
}

# The published shapes (for benchmarks with random weights).
_V2_LITE = {**_V2_LITE_TINY, "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
            "num_key_value_heads": 16, "n_routed_experts": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840,
            "rope_scaling": {**_V2_LITE_TINY["rope_scaling"], "factor": 40, "original_max_position_embeddings": 4096},
            "bos_token_id": 100000, "eos_token_id": 100001}
_V3 = {**_V3_TINY, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
       "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
       "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
       "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
       "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840,
       "rope_scaling": {**_V3_TINY["rope_scaling"], "factor": 40, "original_max_position_embeddings": 4096},
       "num_nextn_predict_layers": 1}

# Step3 (StepFun) text model: MFA attention (low-rank query, one shared 256-dim KV head), 48 experts top-3.
_STEP3_TINY = {
    "architectures": ["Step3TextForCausalLM"], "model_type": "step3_text",
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_attention_groups": 1, "head_dim": 16, "share_q_dim": 32,
    "moe_layers_enum": "1,2", "moe_num_experts": 16, "moe_top_k": 3, "moe_intermediate_size": 32,
    "share_expert_dim": 32, "norm_expert_weight": False, "max_seq_len": 2048, "max_position_embedding": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None, "bos_token_id": 0, "eos_token_id": 1,
    "hidden_act": "silu", "tie_word_embeddings": False,
}
_STEP3 = {**_STEP3_TINY, "vocab_size": 128815, "hidden_size": 7168, "intermediate_size": 18432,
          "num_hidden_layers": 61, "num_attention_heads": 64, "head_dim": 256, "share_q_dim": 2048,
          "moe_layers_enum": ",".join(str(i) for i in range(4, 60)), "moe_num_experts": 48,
          "moe_intermediate_size": 5120, "share_expert_dim": 5120, "max_seq_len": 65536,
          "max_position_embedding": 65536}

# One EP8 rank's share, for single-GPU decode benchmarks: the experts one rank holds and the same
# per-rank expert load (a rank's B tokens x top-k over E/8 experts = the node's 8B tokens x top-k
# over E, restricted to that rank), with as many layers as fit in one H200 beside the KV cache.
_V3_EP8_RANK = {**_V3, "n_routed_experts": 32, "n_group": 8, "topk_group": 4, "num_hidden_layers": 20,
                "num_nextn_predict_layers": 0}
_STEP3_EP8_RANK = {**_STEP3, "moe_num_experts": 6, "num_hidden_layers": 16,
                   "moe_layers_enum": ",".join(str(i) for i in range(4, 15))}

PRESETS = {"v3-tiny": _V3_TINY, "v2-lite-tiny": _V2_LITE_TINY, "deepseek-v2-lite": _V2_LITE, "deepseek-v3": _V3,
           "step3-tiny": _STEP3_TINY, "step3": _STEP3, "deepseek-v3-ep8-rank": _V3_EP8_RANK,
           "step3-ep8-rank": _STEP3_EP8_RANK}


def with_layers(cfg: dict, n: int) -> dict:
    """The same model with n layers, the first dense and the rest MoE."""
    if n < 1:
        raise ValueError(f"layers must be >= 1, got {n}")
    cfg = dict(cfg, num_hidden_layers=n)
    if cfg["model_type"].startswith("step3"):
        cfg["moe_layers_enum"] = ",".join(str(i) for i in range(1, n))
    else:
        cfg["first_k_dense_replace"] = min(1, n)
    return cfg


def preset(name: str, **overrides) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[name])
    cfg.update(overrides)
    return cfg
