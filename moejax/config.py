"""Model configuration read from a Hugging Face ``config.json``.

Only the fields that change the computation are kept. Fields that HF writes for
bookkeeping are accepted and ignored; any other field, or a supported field with
an unsupported value, raises a ValueError naming it, so a checkpoint we would
silently mis-run is refused instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# Fields HF or DeepSeek write that do not affect inference (training knobs,
# bookkeeping, remote-code pointers).
_IGNORED_FIELDS = frozenset({
    "_name_or_path", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp", "aux_loss_alpha",
    "seq_aux", "output_router_logits", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "pad_token_id", "bos_token_id", "eos_token_id", "ep_size", "model_type", "moe_layer_freq",
    "num_nextn_predict_layers", "num_mtp_layers", "qk_head_dim", "head_dim", "quantization_config",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "rope_scaling",
    "rope_parameters", "rope_theta", "rope_interleave", "num_key_value_heads", "n_group",
    "topk_group", "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor",
    "first_k_dense_replace", "n_shared_experts", "q_lora_rank",
})
_REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "rms_norm_eps",
)
_ROPE_KEYS = frozenset({
    "type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
})


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = True  # DeepSeek rotates adjacent pairs (x0,x1),(x2,x3)...


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    q_lora_rank: int | None = None
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    scoring_func: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rope: RopeConfig = RopeConfig()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None  # set for FP8 block-scaled checkpoints
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer: the normalised latent plus the rotated shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.type == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _parse(d)

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return _parse(json.load(f))


def load_model_config(d: dict[str, Any]):
    """The config of any supported family: ModelConfig (DeepSeek) or Step3Config."""
    return _parse(d)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json field {field!r}={value!r}: {why}")


def _parse_rope(d: dict[str, Any]) -> RopeConfig:
    # HF v4 and the published DeepSeek configs use rope_theta + rope_scaling;
    # transformers v5 writes a single rope_parameters dict.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or not isinstance(params, dict):
        raise _bad("rope_scaling", scaling, "must be an object or null")
    params = {**scaling, **params}
    unknown = set(params) - _ROPE_KEYS
    if unknown:
        raise _bad("rope_scaling", sorted(unknown), "unsupported rope parameter(s)")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    interleave = bool(d.get("rope_interleave", True))
    if d["model_type"] == "deepseek_v2" and not interleave:
        raise _bad("rope_interleave", False, "DeepSeek-V2 always uses interleaved rope")
    if rtype == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    if rtype != "yarn":
        raise _bad("rope_scaling.type", rtype, "only 'yarn' rope scaling is supported")
    factor = params.get("factor")
    omax = params.get("original_max_position_embeddings")
    if omax is None:
        raise _bad("rope_scaling.original_max_position_embeddings", None, "required for yarn")
    if factor is None:
        factor = d["max_position_embeddings"] / omax
    return RopeConfig(
        theta=theta, type="yarn", factor=float(factor), original_max_position_embeddings=int(omax),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleave=interleave,
    )


def _parse(d: dict[str, Any]) -> ModelConfig:
    # A vision-language wrapper may nest the text config.
    mt = d.get("model_type")
    if mt in ("step3_text", "step3_vl"):  # Step3 has its own config class (moejax/models/step3_config.py)
        from moejax.models.step3_config import parse_step3_config
        return parse_step3_config(d)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise _bad("model_type", mt, f"supported model types are {list(SUPPORTED_MODEL_TYPES) + ['step3_text', 'step3_vl']}")
    known = set(_REQUIRED_FIELDS) | _IGNORED_FIELDS
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"config.json has unknown or unsupported field(s) {unknown} for model_type {mt!r}")
    missing = [f for f in _REQUIRED_FIELDS if d.get(f) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing}")
    for f in _REQUIRED_FIELDS:
        if f == "rms_norm_eps":
            continue
        if not isinstance(d[f], int) or isinstance(d[f], bool) or d[f] <= 0:
            raise _bad(f, d[f], "must be a positive integer")

    if d.get("hidden_act", "silu") != "silu":
        raise _bad("hidden_act", d["hidden_act"], "only 'silu' is supported")
    if d.get("attention_bias", False):
        raise _bad("attention_bias", True, "attention biases are not supported")
    if d.get("mlp_bias", False):
        raise _bad("mlp_bias", True, "MLP biases are not supported")
    if d.get("tie_word_embeddings", False):
        raise _bad("tie_word_embeddings", True, "DeepSeek checkpoints have a separate lm_head")
    nkv = d.get("num_key_value_heads")
    if nkv is not None and nkv != d["num_attention_heads"]:
        raise _bad("num_key_value_heads", nkv, "MLA expects num_key_value_heads == num_attention_heads")
    if d.get("moe_layer_freq", 1) != 1:
        raise _bad("moe_layer_freq", d["moe_layer_freq"], "only 1 (every layer after the dense ones) is supported")

    if mt == "deepseek_v3":
        scoring = d.get("scoring_func", "sigmoid")
        method = d.get("topk_method", "noaux_tc")
        norm_default, scale_default = True, 2.5
    else:
        scoring = d.get("scoring_func", "softmax")
        method = d.get("topk_method", "greedy")
        norm_default, scale_default = False, 1.0
    if scoring not in ("softmax", "sigmoid"):
        raise _bad("scoring_func", scoring, "supported: 'softmax', 'sigmoid'")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise _bad("topk_method", method, "supported: 'greedy', 'group_limited_greedy', 'noaux_tc'")
    if method == "noaux_tc" and scoring != "sigmoid":
        raise _bad("topk_method", method, "noaux_tc requires scoring_func 'sigmoid'")
    n_group = d.get("n_group") or 1
    topk_group = d.get("topk_group") or 1
    E, k = d["n_routed_experts"], d["num_experts_per_tok"]
    if E % n_group:
        raise _bad("n_group", n_group, f"must divide n_routed_experts={E}")
    if not 1 <= topk_group <= n_group:
        raise _bad("topk_group", topk_group, f"must be in [1, n_group={n_group}]")
    if k > E:
        raise _bad("num_experts_per_tok", k, f"must be <= n_routed_experts={E}")
    if method != "greedy" and k > topk_group * (E // n_group):
        raise _bad("num_experts_per_tok", k, "more experts than the selected groups hold")

    q_lora = d.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise _bad("q_lora_rank", q_lora, "must be a positive integer or null")
    fp8_block = None
    qc = d.get("quantization_config")
    if qc is not None:
        if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
            raise _bad("quantization_config", qc, "only fp8 e4m3 block-scaled checkpoints are supported")
        bs = qc.get("weight_block_size")
        if not (isinstance(bs, list) and len(bs) == 2):
            raise _bad("quantization_config.weight_block_size", bs, "must be [rows, cols]")
        fp8_block = (int(bs[0]), int(bs[1]))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    first_dense = d.get("first_k_dense_replace") or 0
    if first_dense > d["num_hidden_layers"]:
        raise _bad("first_k_dense_replace", first_dense, "exceeds num_hidden_layers")
    n_shared = d.get("n_shared_experts") or 0

    return ModelConfig(
        model_type=mt, **{f: d[f] for f in _REQUIRED_FIELDS},
        q_lora_rank=q_lora, n_shared_experts=int(n_shared), first_k_dense_replace=int(first_dense),
        scoring_func=scoring, topk_method=method, n_group=int(n_group), topk_group=int(topk_group),
        norm_topk_prob=bool(d.get("norm_topk_prob", norm_default)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", scale_default)),
        rope=_parse_rope(d), bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        fp8_block_size=fp8_block,
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0),
    )
