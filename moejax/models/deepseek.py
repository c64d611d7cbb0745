"""DeepSeek-V2/V3/R1: config, model, HF names and presets (``model_type`` deepseek_v2 / deepseek_v3).

Pre-norm residual blocks of MLA attention (moejax/layers/mla.py) and a dense SiLU MLP
(the first ``first_k_dense_replace`` layers) or the MoE block (router + routed experts
+ shared experts, moejax/models/moe.py).

HF names keep HF's layout ([out, in]) and map one to one onto the parameter tree
(``model.layers.3.self_attn.q_a_proj.weight`` -> ``layers_3/self_attn/q_a_proj/weight``),
except the routed experts: one HF tensor per expert
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` [out, in], stacked as
``layers_N/mlp/experts/<proj>`` [E, in, out]. Where MLA merges q_a_proj and
kv_a_proj_with_mqa (moejax/layers/mla.py), their two HF tensors are the rows of one leaf
``layers_N/self_attn/qkv_a_proj`` (``fused_parts``).

Multi-token prediction (DeepSeek-V3/R1, ``num_nextn_predict_layers: 1``): the checkpoint's layer
``num_hidden_layers`` (61) is the MTP module, ``model.layers.61.{enorm,hnorm,eh_proj,shared_head.*}``
plus one MoE decoder layer's tensors. The model builds it as its Flax submodule ``mtp``
(``MTPLayer``) whose parameters sit at ``layers_61``, HF's module path, so the name table, the
expert-parallel sharding and EPLB treat it as one more decoder layer. Its
``model.layers.61.embed_tokens.weight`` is not a parameter: the loader checks it equals the main
embedding, which the MTP forward uses (``shared_tensor``). docs/architecture.md, "Multi-token
prediction (MTP)".
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moejax.layers.forward_batch import ForwardBatch
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.layers.linear import Linear
from moejax.layers.mla import MLA
from moejax.layers.norm import RMSNorm
from moejax.layers.rope import RopeConfig, yarn_mscale
from moejax.models.decoder import CausalLM, PreNormDecoderLayer
from moejax.models.family import ModelFamily
from moejax.models.hf_config import (bad, eos_ids, fp8_block, is_int, refuse_flags, refuse_unknown,
                                     require_positive_ints)
from moejax.weights.param_tree import TOP_LEVEL, ParamRef, default_hf_name

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# ----------------------------------------------------------------------------- config
# Fields HF or DeepSeek write that do not affect inference (training knobs, bookkeeping,
# remote-code pointers), or that the parser reads below with their own checks.
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
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
)
_ROPE_KEYS = frozenset({
    "type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
})


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
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
    def num_cache_layers(self) -> int:
        """The KV-cache layers the model's attention indexes: the decoder layers', then the MTP
        layer's own rows at index num_hidden_layers (its MLA writes and reads cache layer
        ``self.layer``). The runner allocates them all with speculative decoding on (EngineConfig.num_cache_layers),
        else num_hidden_layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.type == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekConfig":
        return parse_config(d)

    @classmethod
    def from_file(cls, path: str) -> "DeepseekConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return parse_config(json.load(f))


def _parse_rope(d: dict[str, Any]) -> RopeConfig:
    # HF v4 and the published DeepSeek configs use rope_theta + rope_scaling;
    # transformers v5 writes a single rope_parameters dict.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or not isinstance(params, dict):
        raise bad("rope_scaling", scaling, "must be an object or null")
    params = {**scaling, **params}
    unknown = set(params) - _ROPE_KEYS
    if unknown:
        raise bad("rope_scaling", sorted(unknown), "unsupported rope parameter(s)")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    interleave = bool(d.get("rope_interleave", True))
    if d["model_type"] == "deepseek_v2" and not interleave:
        raise bad("rope_interleave", False, "DeepSeek-V2 always uses interleaved rope")
    if rtype == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    if rtype != "yarn":
        raise bad("rope_scaling.type", rtype, "only 'yarn' rope scaling is supported")
    factor = params.get("factor")
    omax = params.get("original_max_position_embeddings")
    if omax is None:
        raise bad("rope_scaling.original_max_position_embeddings", None, "required for yarn")
    if factor is None:
        factor = d["max_position_embeddings"] / omax
    return RopeConfig(
        theta=theta, type="yarn", factor=float(factor), original_max_position_embeddings=int(omax),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleave=interleave,
    )


def parse_config(d: dict[str, Any]) -> DeepseekConfig:
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise bad("model_type", mt, f"a DeepSeek config has model_type in {list(MODEL_TYPES)}")
    refuse_unknown(d, set(_REQUIRED_FIELDS) | {"rms_norm_eps"} | _IGNORED_FIELDS, mt)
    require_positive_ints(d, _REQUIRED_FIELDS)
    if d.get("rms_norm_eps") is None:
        raise ValueError("config.json is missing required field(s) ['rms_norm_eps']")
    refuse_flags(d)
    nkv = d.get("num_key_value_heads")
    if nkv is not None and nkv != d["num_attention_heads"]:
        raise bad("num_key_value_heads", nkv, "MLA expects num_key_value_heads == num_attention_heads")
    if d.get("moe_layer_freq", 1) != 1:
        raise bad("moe_layer_freq", d["moe_layer_freq"], "only 1 (every layer after the dense ones) is supported")

    if mt == "deepseek_v3":
        scoring = d.get("scoring_func", "sigmoid")
        method = d.get("topk_method", "noaux_tc")
        norm_default, scale_default = True, 2.5
    else:
        scoring = d.get("scoring_func", "softmax")
        method = d.get("topk_method", "greedy")
        norm_default, scale_default = False, 1.0
    if scoring not in ("softmax", "sigmoid"):
        raise bad("scoring_func", scoring, "supported: 'softmax', 'sigmoid'")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise bad("topk_method", method, "supported: 'greedy', 'group_limited_greedy', 'noaux_tc'")
    if method == "noaux_tc" and scoring != "sigmoid":
        raise bad("topk_method", method, "noaux_tc requires scoring_func 'sigmoid'")
    n_group = d.get("n_group") or 1
    topk_group = d.get("topk_group") or 1
    E, k = d["n_routed_experts"], d["num_experts_per_tok"]
    if E % n_group:
        raise bad("n_group", n_group, f"must divide n_routed_experts={E}")
    if not 1 <= topk_group <= n_group:
        raise bad("topk_group", topk_group, f"must be in [1, n_group={n_group}]")
    if k > E:
        raise bad("num_experts_per_tok", k, f"must be <= n_routed_experts={E}")
    if method != "greedy" and k > topk_group * (E // n_group):
        raise bad("num_experts_per_tok", k, "more experts than the selected groups hold")

    q_lora = d.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise bad("q_lora_rank", q_lora, "must be a positive integer or null")
    first_dense = d.get("first_k_dense_replace") or 0
    if first_dense > d["num_hidden_layers"]:
        raise bad("first_k_dense_replace", first_dense, "exceeds num_hidden_layers")
    mtp_field = "num_nextn_predict_layers" if d.get("num_nextn_predict_layers") is not None else "num_mtp_layers"
    mtp = d.get(mtp_field) or 0
    if not is_int(mtp) or not 0 <= mtp <= 1:
        raise bad(mtp_field, mtp, "0 or 1 multi-token-prediction layers are supported (DeepSeek-V3 ships 1)")
    return DeepseekConfig(
        model_type=mt, **{f: d[f] for f in _REQUIRED_FIELDS}, rms_norm_eps=float(d["rms_norm_eps"]),
        q_lora_rank=q_lora, n_shared_experts=int(d.get("n_shared_experts") or 0),
        first_k_dense_replace=int(first_dense),
        scoring_func=scoring, topk_method=method, n_group=int(n_group), topk_group=int(topk_group),
        norm_topk_prob=bool(d.get("norm_topk_prob", norm_default)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", scale_default)),
        rope=_parse_rope(d), bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids(d.get("eos_token_id")),
        fp8_block_size=fp8_block(d.get("quantization_config")),
        num_nextn_predict_layers=mtp,
    )


# ----------------------------------------------------------------------------- model
class DecoderLayer(PreNormDecoderLayer):
    attention = MLA  # the ffn: dense on the first first_k_dense_replace layers, MoE after


def require_mtp(cfg: DeepseekConfig) -> None:
    """Refuses what needs the MTP module (speculative decoding's drafts) on a config without one."""
    if not getattr(cfg, "num_nextn_predict_layers", 0):
        raise ValueError(f"this {cfg.model_type} config has num_nextn_predict_layers 0: no multi-token-prediction "
                         "(MTP) layer to draft with; speculative decoding needs a checkpoint that ships one "
                         "(DeepSeek-V3/R1: num_nextn_predict_layers 1, the tensors of "
                         "model.layers.<num_hidden_layers>)")


class SharedHead(nn.Module):
    """The MTP layer's output head: HF's ``shared_head.norm`` and ``shared_head.head`` [vocab, hidden]."""
    cfg: Any
    dtype: Any = jnp.float32
    fp8: Fp8Policy = NO_FP8

    def setup(self):
        c = self.cfg
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.head = Linear(c.hidden_size, c.vocab_size, self.dtype, self.fp8.scheme("lm_head"))

    def __call__(self, h):
        return self.head(self.norm(h), jnp.float32)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (vLLM's DeepSeekMultiTokenPredictorLayer): a decoder
    layer (MLA + MoE: its index num_hidden_layers is past first_k_dense_replace) whose input is
    ``eh_proj(concat(enorm(embed(token)), hnorm(previous_hidden)))`` and whose output goes through
    its own ``shared_head`` (norm, head). ``eh_proj`` [H, 2H] is bf16 in DeepSeek's FP8 checkpoint
    (vLLM and SGLang build it as a plain nn.Linear): it keeps the model dtype under any FP8 policy;
    the decoder layer follows the policy like every other layer."""

    def setup_extra(self):
        c = self.cfg
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, self.dtype)
        self.shared_head = SharedHead(c, self.dtype, self.fp8)

    def project(self, embeds, previous_hidden):
        """The decoder layer's input: eh_proj(concat(enorm(embeds), hnorm(previous_hidden)))."""
        e = self.enorm(embeds)
        return self.eh_proj(jnp.concatenate([e, self.hnorm(previous_hidden).astype(e.dtype)], axis=-1))


class DeepseekForCausalLM(CausalLM):
    """The DeepSeek causal LM, with the MTP module ``mtp`` (parameters ``layers_<num_hidden_layers>``)
    where the config has one."""
    decoder_layer = DecoderLayer

    def setup(self):
        super().setup()
        c = self.cfg
        if c.num_nextn_predict_layers:
            L = c.num_hidden_layers
            self.mtp = MTPLayer(c, L, self.dtype, self.ep, self.fp8, name=f"layers_{L}")

    def mtp_hidden(self, tokens, previous_hidden, batch: ForwardBatch, cache=None):
        """The MTP layer's hidden states (before its shared_head norm; what a second draft step would take
        as ``previous_hidden``) and the cache. Row i pairs the main model's hidden state at position i
        (``previous_hidden``, before the final norm: what ``prefill``/``decode`` return) with the token
        that follows it (``tokens``: t_{i+1}) at ``batch.positions`` i, as vLLM and SGLang feed it. Shapes
        and the prefill forms (dense [B, S], paged chunk, packed) as ``prefill``; with a cache, the MTP
        layer writes and reads cache layer num_hidden_layers (``cfg.num_cache_layers`` layers)."""
        require_mtp(self.cfg)
        x = self.mtp.project(self.embed_tokens(tokens), previous_hidden)
        return self.mtp.prefill(x, batch, cache)

    def mtp_decode(self, tokens, previous_hidden, batch: ForwardBatch, cache):
        """The MTP layer as a decode step over rows [R] (each row one token, already counted in
        batch.seq_lens; rows of one sequence may be consecutive positions, each attending up to itself):
        what speculative decoding drafts with (moejax/engine/speculative.py). Returns (hidden states
        [R, H], cache)."""
        require_mtp(self.cfg)
        x = self.mtp.project(self.embed_tokens(tokens), previous_hidden)
        return self.mtp.decode(x, batch, cache)

    def mtp_logits(self, h):
        """The MTP layer's logits (float32) of its hidden states: shared_head.head(shared_head.norm(h))."""
        require_mtp(self.cfg)
        return self.mtp.shared_head(h)

    def __call__(self, tokens):
        """Used only to create parameters (init): the MTP layer's too."""
        B, S = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(S), (B, S))
        batch = ForwardBatch.prefill(pos, jnp.full((B,), S))
        h, _ = self.prefill(tokens, batch)
        if self.cfg.num_nextn_predict_layers:
            m, _ = self.mtp_hidden(tokens, h, batch)
            self.mtp_logits(m)
        return self.logits(h)


# ----------------------------------------------------------------------------- HF names
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")


_QKV_A = "qkv_a_proj"  # MLA's merged [q_a_proj | kv_a_proj_with_mqa]: not an HF module


def hf_to_param(name: str) -> ParamRef | None:
    """Where an HF tensor goes, or None if the name is not a model weight we know. q_a_proj and
    kv_a_proj_with_mqa point at their own paths; ``fused_parts`` says when the model merges them."""
    if name in TOP_LEVEL:
        return ParamRef(TOP_LEVEL[name])
    m = _EXPERT.match(name)
    if m:
        layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        return ParamRef((f"layers_{layer}", "mlp", "experts", proj), e, layer)
    m = _LAYER.match(name)
    if m and _QKV_A not in m.group(2).split("."):
        return ParamRef((f"layers_{m.group(1)}", *m.group(2).split(".")), None, int(m.group(1)))
    return None


def param_to_hf(path: tuple[str, ...], expert: int | None = None) -> str:
    """Inverse of hf_to_param, for messages and for writing HF checkpoints."""
    if path[1:3] == ("mlp", "experts"):
        e = expert if expert is not None else "*"
        return f"model.layers.{path[0].removeprefix('layers_')}.mlp.experts.{e}.{path[3]}.weight"
    return default_hf_name(path)


def fused_parts(cfg: DeepseekConfig, path: tuple[str, ...]):
    """``layers_N/self_attn/qkv_a_proj/weight`` is HF's q_a_proj.weight [q_lora_rank, H] stacked on
    kv_a_proj_with_mqa.weight [kv_lora_rank + qk_rope_head_dim, H]; every other leaf is one tensor."""
    if path[1:] != ("self_attn", _QKV_A, "weight"):
        return None
    attn = path[:2]
    return ((attn + ("q_a_proj", "weight"), cfg.q_lora_rank),
            (attn + ("kv_a_proj_with_mqa", "weight"), cfg.kv_cache_dim))


_MTP_EMBED = re.compile(r"model\.layers\.(\d+)\.embed_tokens\.weight$")


def shared_tensor(name: str, cfg: DeepseekConfig) -> str | None:
    """The MTP layer's ``model.layers.<L>.embed_tokens.weight`` (L = num_hidden_layers): DeepSeek-V3's
    copy of the main embedding, which the model shares rather than stores twice. The loader checks the
    two are equal (an MTP layer with an embedding of its own is refused)."""
    m = _MTP_EMBED.match(name)
    if m and cfg.num_hidden_layers <= int(m.group(1)) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
        return "model.embed_tokens.weight"
    return None


def fit_config(hf_config: dict, names) -> tuple[dict, str | None]:
    """config.json contents for a checkpoint holding the tensors ``names``: a config with an MTP layer
    that the checkpoint lacks altogether (converted without it) loads without it
    (num_nextn_predict_layers 0, and a message saying so), as before MTP was loaded; a partial MTP
    layer is left to the loader, which names what is missing."""
    n = hf_config.get("num_nextn_predict_layers")
    n, L = (hf_config.get("num_mtp_layers") if n is None else n) or 0, hf_config.get("num_hidden_layers")
    if not (is_int(n) and n > 0 and is_int(L)):  # none asked for, or a value parse_config refuses
        return hf_config, None
    prefixes = tuple(f"model.layers.{L + i}." for i in range(n))
    if any(name.startswith(prefixes) for name in names):
        return hf_config, None
    return (dict(hf_config, num_nextn_predict_layers=0),
            f"config.json has num_nextn_predict_layers {n} but the checkpoint holds no tensor of its MTP layer "
            f"(model.layers.{L}.*): loaded without it (no speculative decoding with this checkpoint)")


def add_checkpoint_extras(cfg: DeepseekConfig, tensors: dict, seed: int, dtype) -> dict:
    """A random checkpoint with an MTP layer carries that layer's copy of the embedding, as DeepSeek-V3's does."""
    for i in range(cfg.num_nextn_predict_layers):
        tensors[f"model.layers.{cfg.num_hidden_layers + i}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def is_fp8_quantized(name: str) -> bool:
    """Which tensors DeepSeek-V3 stores in float8: the projection matrices, not the
    embeddings, lm_head, norms or router, nor the MTP layer's eh_proj (bf16 there, as its
    shared_head.head)."""
    if name.endswith("eh_proj.weight"):
        return False
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


# ----------------------------------------------------------------------------- presets
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
# One EP8 rank's share, for single-GPU decode benchmarks: the experts one rank holds and the same
# per-rank expert load (a rank's B tokens x top-k over E/8 experts = the node's 8B tokens x top-k
# over E, restricted to that rank), with as many layers as fit in one H200 beside the KV cache.
_V3_EP8_RANK = {**_V3, "n_routed_experts": 32, "n_group": 8, "topk_group": 4, "num_hidden_layers": 20,
                "num_nextn_predict_layers": 0}

PRESETS = {"v3-tiny": _V3_TINY, "v2-lite-tiny": _V2_LITE_TINY, "deepseek-v2-lite": _V2_LITE, "deepseek-v3": _V3,
           "deepseek-v3-ep8-rank": _V3_EP8_RANK}


def with_layers(cfg: dict, n: int) -> dict:
    """The same model with n layers, the first dense and the rest MoE."""
    return dict(copy.deepcopy(cfg), num_hidden_layers=n, first_k_dense_replace=min(1, n))


FAMILY = ModelFamily(
    name="deepseek", model_types=MODEL_TYPES, parse_config=parse_config, causal_lm=DeepseekForCausalLM,
    hf_to_param=hf_to_param, param_to_hf=param_to_hf, experts_stacked_on_disk=False,
    is_fp8_quantized=is_fp8_quantized, presets=PRESETS, with_layers=with_layers,
    fused_parts=fused_parts, shared_tensor=shared_tensor, fit_config=fit_config,
    add_checkpoint_extras=add_checkpoint_extras,
    fp8_kv_cache=True,
    transformers_classes={"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                          "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM")},
)
