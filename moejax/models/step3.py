"""StepFun Step3 text model: config, model, HF names and presets (``model_type`` step3_text / step3_vl).

Pre-norm residual blocks of MFA attention (moejax/layers/mfa.py) and a dense SiLU MLP, or
on the layers of ``moe_layers_enum`` a softmax top-k MoE (weights not renormalised unless
``norm_expert_weight``) plus one shared expert beside it (``share_expert``).

``step3_vl`` (the vision-language wrapper) holds the text config in ``text_config``; only
the text model is built. Its checkpoint prefixes the text weights (``language_model.`` or
``model.language_model.``, stripped) and carries vision-tower tensors (read past).

HF names keep HF's layout ([out, in]):

  model.layers.N.self_attn.{q,k,v}_proj / inter_norm / wq / o_proj  -> layers_N/self_attn/...
  model.layers.N.{input,post_attention}_layernorm                   -> layers_N/...
  model.layers.N.mlp.{gate,up,down}_proj (dense layers)             -> layers_N/mlp/...
  model.layers.N.moe.gate (router [E, H])                           -> layers_N/mlp/gate
  model.layers.N.moe.{gate,up,down}_proj ([E, out, in], stacked)    -> layers_N/mlp/experts/<proj> ([E, in, out])
  model.layers.N.share_expert.{gate,up,down}_proj                   -> layers_N/share_expert/...
  model.embed_tokens, model.norm, lm_head

The routed experts sit at ``layers_N/mlp/experts`` as DeepSeek's do, so expert-parallel
sharding, EPLB and the dispatch apply unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import numpy as np

from moejax.layers.mfa import MFA
from moejax.layers.mlp import GatedMLP
from moejax.layers.rope import RopeConfig
from moejax.models.decoder import CausalLM, PreNormDecoderLayer
from moejax.models.family import ModelFamily
from moejax.models.hf_config import (bad, eos_ids, fp8_block, is_int, refuse_flags, refuse_unknown,
                                     require_positive_ints)
from moejax.weights.param_tree import TOP_LEVEL, ParamRef, default_hf_name

MODEL_TYPES = ("step3_text", "step3_vl")

# ----------------------------------------------------------------------------- config
# Bookkeeping fields of the text config that do not change the computation, or that the parser
# reads below with their own checks.
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

    @property
    def num_cache_layers(self) -> int:
        """The KV-cache layers the attention indexes (no MTP layer is built for Step3)."""
        return self.num_hidden_layers

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
        return parse_config(d)


def _moe_layers(value: Any, num_layers: int, field: str) -> tuple[int, ...]:
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().split(",") if p.strip()]
        try:
            layers = [int(p) for p in parts]
        except ValueError:
            raise bad(field, value, "must be comma-separated layer indices") from None
    elif isinstance(value, (list, tuple)) and all(is_int(v) for v in value):
        layers = list(value)
    else:
        raise bad(field, value, "must be a comma-separated string or a list of layer indices")
    out_of_range = [i for i in layers if not 0 <= i < num_layers]
    if out_of_range:
        raise bad(field, value, f"layer index {out_of_range[0]} outside [0, num_hidden_layers={num_layers})")
    if len(set(layers)) != len(layers):
        raise bad(field, value, "repeats a layer index")
    return tuple(sorted(layers))


def _rope(d: dict[str, Any]) -> RopeConfig:
    theta = d.get("rope_theta", 500000.0)
    params = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    theta = params.pop("rope_theta", theta)
    rtype = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rtype != "default" or params:
        raise bad("rope_scaling", d.get("rope_scaling") or d.get("rope_parameters"),
                  "Step3 supports only default (unscaled) rope")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise bad("rope_theta", theta, "must be a positive number")
    return RopeConfig(theta=float(theta), interleave=False)  # rotate-half (NeoX) over the whole head


def parse_config(d: dict[str, Any]) -> Step3Config:
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise bad("model_type", mt, f"a Step3 config has model_type in {list(MODEL_TYPES)}")
    prefix = ""
    outer: dict[str, Any] = {}
    if mt == "step3_vl":
        refuse_unknown(d, _VL_FIELDS, mt)
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise bad("text_config", text, "a step3_vl config must hold the text model's config as an object")
        if text.get("model_type", "step3_text") != "step3_text":
            raise bad("text_config.model_type", text.get("model_type"), "must be 'step3_text'")
        if d.get("tie_word_embeddings", False):
            raise bad("tie_word_embeddings", True, "Step3 checkpoints have a separate lm_head")
        outer, d, prefix = d, text, "text_config."
    f = lambda name: prefix + name  # noqa: E731  (field name as the user wrote it)

    refuse_unknown(d, _TEXT_KNOWN, "step3_text", prefix)
    if d.get("moe_layers_enum") is None:
        raise ValueError(f"config.json is missing required field(s) {[f('moe_layers_enum')]}")
    require_positive_ints(d, _TEXT_REQUIRED, prefix)
    groups = d.get("num_attention_groups", d.get("num_key_value_heads", 1))
    if not is_int(groups) or groups <= 0:
        raise bad(f("num_attention_groups"), groups, "must be a positive integer")
    if d["num_attention_heads"] % groups:
        raise bad(f("num_attention_groups"), groups, f"must divide num_attention_heads={d['num_attention_heads']}")
    if "num_key_value_heads" in d and d["num_key_value_heads"] != groups:
        raise bad(f("num_key_value_heads"), d["num_key_value_heads"], f"differs from num_attention_groups={groups}")
    E, k = d["moe_num_experts"], d["moe_top_k"]
    if k > E:
        raise bad(f("moe_top_k"), k, f"must be <= moe_num_experts={E}")
    refuse_flags(d, prefix)
    norm_w = d.get("norm_expert_weight", False)
    if not isinstance(norm_w, bool):
        raise bad(f("norm_expert_weight"), norm_w, "must be true or false")
    eps = d.get("rms_norm_eps", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise bad(f("rms_norm_eps"), eps, "must be a positive number")

    max_pos = None
    for key in ("max_position_embedding", "max_position_embeddings", "max_seq_len"):
        if d.get(key) is not None:
            max_pos, max_key = d[key], key
            break
    if max_pos is None:
        raise ValueError(f"config.json is missing required field(s) {[f('max_position_embedding')]}")
    if not is_int(max_pos) or max_pos <= 1:
        raise bad(f(max_key), max_pos, "must be an integer > 1")

    L = d["num_hidden_layers"]
    fp8 = fp8_block(d.get("quantization_config"), f("quantization_config"))
    if fp8 is None:
        fp8 = fp8_block(outer.get("quantization_config"), "quantization_config")
    return Step3Config(
        model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=L,
        num_attention_heads=d["num_attention_heads"], num_attention_groups=groups, head_dim=d["head_dim"],
        share_q_dim=d["share_q_dim"], moe_intermediate_size=d["moe_intermediate_size"], n_routed_experts=E,
        num_experts_per_tok=k, share_expert_dim=d["share_expert_dim"],
        moe_layers=_moe_layers(d["moe_layers_enum"], L, f("moe_layers_enum")),
        max_position_embeddings=max_pos, rms_norm_eps=float(eps), rope=_rope(d), norm_topk_prob=norm_w,
        bos_token_id=d.get("bos_token_id", outer.get("bos_token_id")),
        eos_token_ids=eos_ids(d.get("eos_token_id", outer.get("eos_token_id"))), fp8_block_size=fp8,
    )


# ----------------------------------------------------------------------------- model
class Step3DecoderLayer(PreNormDecoderLayer):
    attention = MFA

    def setup_extra(self):
        # Step3's shared expert is the layer's module (HF: layers.N.share_expert), not the MoE block's
        # (Step3Config.n_shared_experts = 0); ffn hands it to the MoE block, which adds it.
        c = self.cfg
        if c.is_moe_layer(self.layer):
            self.share_expert = GatedMLP(c.hidden_size, c.share_expert_dim, self.dtype, self.fp8.scheme("shared_experts"))

    def ffn(self, x, valid):
        if not self.cfg.is_moe_layer(self.layer):
            return self.mlp(x)
        return self.mlp(x, valid, self.share_expert)  # the MoE block adds it (fused with the experts where it can)


class Step3ForCausalLM(CausalLM):
    decoder_layer = Step3DecoderLayer


# ----------------------------------------------------------------------------- HF names
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"moe\.(gate_proj|up_proj|down_proj)\.weight$")
# Top-level modules of the Step3-VL checkpoint (and common VL spellings) that belong to the vision side.
_VISION_PREFIXES = ("vision_model.", "vision_tower.", "vit_downsampler.", "vit_downsampler2.",
                    "vit_large_projector.", "multi_modal_projector.", "visual.")
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
VL_PREFIX = "language_model."  # what the tiny writer puts before a step3_vl checkpoint's text weights


def is_vision_tensor(name: str, cfg: Any = None) -> bool:
    return name.removeprefix("model.").startswith(_VISION_PREFIXES)


def canonical_name(name: str) -> str:
    """Strips a vision-language checkpoint's language-model prefix."""
    for prefix, repl in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


def hf_to_param(name: str) -> ParamRef | None:
    """Where an HF tensor goes, or None if the name is not a Step3 text-model weight."""
    name = canonical_name(name)
    if name in TOP_LEVEL:
        return ParamRef(TOP_LEVEL[name])
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    top = f"layers_{layer}"
    e = _EXPERTS.match(rest)
    if e:
        return ParamRef((top, "mlp", "experts", e.group(1)), layer=layer, stacked=True)
    if rest == "moe.gate.weight":
        return ParamRef((top, "mlp", "gate", "weight"), layer=layer)
    parts = tuple(rest.split("."))
    if parts[0] == "moe" or (parts[0] == "mlp" and len(parts) > 1 and parts[1] in ("gate", "experts")):
        return None  # not a Step3 name (DeepSeek-style MoE names land here)
    return ParamRef((top, *parts), layer=layer)


def param_to_hf(path: tuple[str, ...], expert: int | None = None) -> str:
    """Inverse of hf_to_param (without any VL prefix), for messages and for writing checkpoints."""
    if path[1:3] in (("mlp", "experts"), ("mlp", "gate")):  # Step3 calls its MoE block "moe"
        leaf = path[3] if path[2] == "experts" else "gate"
        return f"model.layers.{path[0].removeprefix('layers_')}.moe.{leaf}.weight"
    return default_hf_name(path)


def is_fp8_quantized(name: str) -> bool:
    """Which tensors a block-FP8 Step3 checkpoint stores in float8 (as written by the tiny writer):
    every projection matrix, including the stacked experts; not embeddings, lm_head, norms or router."""
    name = canonical_name(name)
    return (name.endswith("proj.weight") or name.endswith(".wq.weight")) and name.startswith("model.layers.")


def add_vl_extras(cfg: Step3Config, tensors: dict, seed: int, dtype) -> dict:
    """A step3_vl checkpoint: text weights under ``language_model.`` and a few stand-ins for the
    vision tower and projector (names as published; the loader reads past them)."""
    if cfg.model_type != "step3_vl":
        return tensors
    rng = np.random.default_rng(seed)
    vision = {
        "vision_model.embeddings.patch_embedding.weight": rng.standard_normal((8, 3, 4, 4)),
        "vision_model.transformer.layers.0.self_attn.qkv_proj.weight": rng.standard_normal((24, 8)),
        "vit_downsampler.weight": rng.standard_normal((8, 8, 2, 2)),
        "vit_large_projector.weight": rng.standard_normal((16, 8)),
    }
    return {**{VL_PREFIX + k: v for k, v in tensors.items()}, **{k: v.astype(dtype) for k, v in vision.items()}}


# ----------------------------------------------------------------------------- presets
# MFA attention (low-rank query, one shared 256-dim KV head), 48 experts top-3.
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
# One EP8 rank's share (6 of 48 experts), for single-GPU decode benchmarks.
_STEP3_EP8_RANK = {**_STEP3, "moe_num_experts": 6, "num_hidden_layers": 16,
                   "moe_layers_enum": ",".join(str(i) for i in range(4, 15))}

PRESETS = {"step3-tiny": _STEP3_TINY, "step3": _STEP3, "step3-ep8-rank": _STEP3_EP8_RANK}


def with_layers(cfg: dict, n: int) -> dict:
    """The same model with n layers, the first dense and the rest MoE."""
    return dict(copy.deepcopy(cfg), num_hidden_layers=n, moe_layers_enum=",".join(str(i) for i in range(1, n)))


FAMILY = ModelFamily(
    name="step3", model_types=MODEL_TYPES, parse_config=parse_config, causal_lm=Step3ForCausalLM,
    hf_to_param=hf_to_param, param_to_hf=param_to_hf, experts_stacked_on_disk=True,
    is_fp8_quantized=is_fp8_quantized, presets=PRESETS, with_layers=with_layers, ignores=is_vision_tensor,
    add_checkpoint_extras=add_vl_extras,
    fp8_kv_cache=False,  # MFA's FP8 cache path has not been checked against a reference
)
