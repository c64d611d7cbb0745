"""Step3 (StepFun) text-model configuration, read from an HF ``config.json``.

Accepts the text config (``model_type`` "step3_text") and the vision-language
wrapper ("step3_vl") whose ``text_config`` holds it; only the text model is
built. As for DeepSeek, any field we do not know, or a known field with a value
we cannot run, raises a ValueError naming it.

``Step3Config`` exposes the attribute names the shared engine code reads
(num_hidden_layers, kv_cache_dim, n_routed_experts, the router knobs of
``select_experts``, ...), so the cache, runner, loader and API are shared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moejax.config import RopeConfig

STEP3_MODEL_TYPES = ("step3_text", "step3_vl")

# Bookkeeping fields of the text config that do not change the computation.
_TEXT_IGNORED = frozenset({
    "_name_or_path", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "model_type",
    "use_cache", "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "pad_token_id", "bos_token_id", "eos_token_id", "quantization_config", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "hidden_act", "rope_scaling", "rope_parameters", "rope_theta",
    "max_seq_len", "max_position_embedding", "max_position_embeddings", "num_attention_groups",
    "norm_expert_weight", "rms_norm_eps", "num_key_value_heads",
})
_TEXT_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "share_q_dim", "moe_intermediate_size", "moe_num_experts", "moe_top_k", "share_expert_dim",
)
_TEXT_KNOWN = _TEXT_IGNORED | set(_TEXT_REQUIRED) | {"moe_layers_enum"}
# Fields of the vision-language wrapper: the vision tower and projector are not built.
_VL_FIELDS = frozenset({
    "_name_or_path", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "model_type",
    "text_config", "vision_config", "understand_projector_stride", "projector_bias", "image_token_id",
    "image_token_index", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "use_cache", "initializer_range",
})


@dataclasses.dataclass(frozen=True)
class Step3Config:
    model_type: str  # "step3_text" or "step3_vl" (the config.json's top level)
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers
    num_hidden_layers: int
    num_attention_heads: int
    num_attention_groups: int  # KV heads (1 in the published model)
    head_dim: int
    share_q_dim: int  # low-rank query width
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    share_expert_dim: int
    moe_layers: tuple[int, ...]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig(theta=500000.0, interleave=False)
    norm_topk_prob: bool = False  # HF's norm_expert_weight
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None
    # Router knobs read by moejax.layers.router.select_experts: softmax over all experts, greedy top-k.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    family: str = "step3"

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer: the rotated K and the V of every KV head, [k | v]."""
        return 2 * self.num_attention_groups * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def n_shared_experts(self) -> int:
        """The shared MoE block adds no shared expert: Step3's sits beside it (share_expert)."""
        return 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Step3Config":
        return parse_step3_config(d)


def is_step3(cfg) -> bool:
    return getattr(cfg, "family", None) == "step3"


def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json field {field!r}={value!r}: {why}")


def _moe_layers(value: Any, num_layers: int, field: str) -> tuple[int, ...]:
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().split(",") if p.strip()]
        try:
            layers = [int(p) for p in parts]
        except ValueError:
            raise _bad(field, value, "must be comma-separated layer indices") from None
    elif isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        layers = list(value)
    else:
        raise _bad(field, value, "must be a comma-separated string or a list of layer indices")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise _bad(field, value, f"layer index {bad[0]} outside [0, num_hidden_layers={num_layers})")
    if len(set(layers)) != len(layers):
        raise _bad(field, value, "repeats a layer index")
    return tuple(sorted(layers))


def _rope(d: dict[str, Any]) -> RopeConfig:
    theta = d.get("rope_theta", 500000.0)
    params = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    theta = params.pop("rope_theta", theta)
    rtype = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rtype != "default" or params:
        raise _bad("rope_scaling", d.get("rope_scaling") or d.get("rope_parameters"),
                   "Step3 supports only default (unscaled) rope")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise _bad("rope_theta", theta, "must be a positive number")
    return RopeConfig(theta=float(theta), interleave=False)  # rotate-half (NeoX) over the whole head


def _fp8_block(qc: Any, field: str) -> tuple[int, int] | None:
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise _bad(field, qc, "only fp8 e4m3 block-scaled checkpoints are supported")
    bs = qc.get("weight_block_size")
    if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
        raise _bad(f"{field}.weight_block_size", bs, "must be [rows, cols]")
    return (bs[0], bs[1])


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def parse_step3_config(d: dict[str, Any]) -> Step3Config:
    mt = d.get("model_type")
    if mt not in STEP3_MODEL_TYPES:
        raise _bad("model_type", mt, f"a Step3 config has model_type in {list(STEP3_MODEL_TYPES)}")
    prefix = ""
    outer: dict[str, Any] = {}
    if mt == "step3_vl":
        unknown = sorted(set(d) - _VL_FIELDS)
        if unknown:
            raise ValueError(f"config.json has unknown or unsupported field(s) {unknown} for model_type 'step3_vl'")
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise _bad("text_config", text, "a step3_vl config must hold the text model's config as an object")
        if text.get("model_type", "step3_text") != "step3_text":
            raise _bad("text_config.model_type", text.get("model_type"), "must be 'step3_text'")
        if d.get("tie_word_embeddings", False):
            raise _bad("tie_word_embeddings", True, "Step3 checkpoints have a separate lm_head")
        outer, d, prefix = d, text, "text_config."
    f = lambda name: prefix + name  # noqa: E731  (field name as the user wrote it)

    unknown = sorted(set(d) - _TEXT_KNOWN)
    if unknown:
        raise ValueError(f"config.json has unknown or unsupported field(s) {[f(u) for u in unknown]} "
                         "for model_type 'step3_text'")
    missing = [f(k) for k in (*_TEXT_REQUIRED, "moe_layers_enum") if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing}")
    for k in _TEXT_REQUIRED:
        if not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] <= 0:
            raise _bad(f(k), d[k], "must be a positive integer")
    groups = d.get("num_attention_groups", d.get("num_key_value_heads", 1))
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
        raise _bad(f("num_attention_groups"), groups, "must be a positive integer")
    if d["num_attention_heads"] % groups:
        raise _bad(f("num_attention_groups"), groups,
                   f"must divide num_attention_heads={d['num_attention_heads']}")
    if "num_key_value_heads" in d and d["num_key_value_heads"] != groups:
        raise _bad(f("num_key_value_heads"), d["num_key_value_heads"], f"differs from num_attention_groups={groups}")
    E, k = d["moe_num_experts"], d["moe_top_k"]
    if k > E:
        raise _bad(f("moe_top_k"), k, f"must be <= moe_num_experts={E}")
    if d.get("hidden_act", "silu") != "silu":
        raise _bad(f("hidden_act"), d["hidden_act"], "only 'silu' is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag, False):
            raise _bad(f(flag), True, "biases are not supported")
    if d.get("tie_word_embeddings", False):
        raise _bad(f("tie_word_embeddings"), True, "Step3 checkpoints have a separate lm_head")
    norm_w = d.get("norm_expert_weight", False)
    if not isinstance(norm_w, bool):
        raise _bad(f("norm_expert_weight"), norm_w, "must be true or false")
    eps = d.get("rms_norm_eps", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise _bad(f("rms_norm_eps"), eps, "must be a positive number")

    max_pos = None
    for key in ("max_position_embedding", "max_position_embeddings", "max_seq_len"):
        if d.get(key) is not None:
            max_pos, max_key = d[key], key
            break
    if max_pos is None:
        raise ValueError(f"config.json is missing required field(s) {[f('max_position_embedding')]}")
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos <= 1:
        raise _bad(f(max_key), max_pos, "must be an integer > 1")

    L = d["num_hidden_layers"]
    fp8 = _fp8_block(d.get("quantization_config"), f("quantization_config"))
    if fp8 is None:
        fp8 = _fp8_block(outer.get("quantization_config"), "quantization_config")
    bos = d.get("bos_token_id", outer.get("bos_token_id"))
    eos = d.get("eos_token_id", outer.get("eos_token_id"))
    return Step3Config(
        model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=L,
        num_attention_heads=d["num_attention_heads"], num_attention_groups=groups, head_dim=d["head_dim"],
        share_q_dim=d["share_q_dim"], moe_intermediate_size=d["moe_intermediate_size"], n_routed_experts=E,
        num_experts_per_tok=k, share_expert_dim=d["share_expert_dim"],
        moe_layers=_moe_layers(d["moe_layers_enum"], L, f("moe_layers_enum")),
        max_position_embeddings=max_pos, rms_norm_eps=float(eps), rope=_rope(d), norm_topk_prob=norm_w,
        bos_token_id=bos, eos_token_ids=_eos(eos), fp8_block_size=fp8,
    )
