"""The table between Step3 HF checkpoint tensor names and moejax's parameter pytree.

Dense tensors keep HF's layout ([out, in]); names map as

  model.layers.N.self_attn.{q,k,v}_proj / inter_norm / wq / o_proj  -> layers_N/self_attn/...
  model.layers.N.{input,post_attention}_layernorm                   -> layers_N/...
  model.layers.N.mlp.{gate,up,down}_proj (dense layers)             -> layers_N/mlp/...
  model.layers.N.moe.gate (router [E, H])                           -> layers_N/mlp/gate
  model.layers.N.moe.{gate,up,down}_proj ([E, out, in], stacked)    -> layers_N/mlp/experts/<proj> ([E, in, out])
  model.layers.N.share_expert.{gate,up,down}_proj                   -> layers_N/share_expert/...
  model.embed_tokens, model.norm, lm_head

Vision-language checkpoints may prefix the text weights (``language_model.``,
``model.language_model.``); the prefix is stripped. Vision-tower and projector
tensors are recognised and ignored.
"""

from __future__ import annotations

import re
from typing import Iterator, NamedTuple

import numpy as np

from moejax.weights.hf_names import flatten, is_stacked_expert

_TOP = {
    "model.embed_tokens.weight": ("embed_tokens", "weight"),
    "model.norm.weight": ("norm", "weight"),
    "lm_head.weight": ("lm_head", "weight"),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"moe\.(gate_proj|up_proj|down_proj)\.weight$")
# Top-level modules of the Step3-VL checkpoint (and common VL spellings) that belong to the vision side.
_VISION_PREFIXES = ("vision_model.", "vision_tower.", "vit_downsampler.", "vit_downsampler2.",
                    "vit_large_projector.", "multi_modal_projector.", "visual.")
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))


class Step3Ref(NamedTuple):
    path: tuple[str, ...]
    layer: int | None = None
    stacked: bool = False  # a whole [E, out, in] expert tensor, stored [E, in, out]


def is_vision_tensor(name: str) -> bool:
    bare = name.removeprefix("model.")
    return bare.startswith(_VISION_PREFIXES)


def canonical_name(name: str) -> str:
    """Strips a vision-language checkpoint's language-model prefix."""
    for prefix, repl in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


def hf_to_param(name: str) -> Step3Ref | None:
    """Where an HF tensor goes, or None if the name is not a Step3 text-model weight."""
    name = canonical_name(name)
    if name in _TOP:
        return Step3Ref(_TOP[name])
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    top = f"layers_{layer}"
    e = _EXPERTS.match(rest)
    if e:
        return Step3Ref((top, "mlp", "experts", e.group(1)), layer, stacked=True)
    if rest == "moe.gate.weight":
        return Step3Ref((top, "mlp", "gate", "weight"), layer)
    parts = tuple(rest.split("."))
    if parts[0] == "moe" or (parts[0] == "mlp" and len(parts) > 1 and parts[1] in ("gate", "experts")):
        return None  # not a Step3 name (DeepSeek-style MoE names land here)
    return Step3Ref((top, *parts), layer)


def param_to_hf(path: tuple[str, ...]) -> str:
    """Inverse of hf_to_param (without any VL prefix), for messages and for writing checkpoints."""
    for hf, p in _TOP.items():
        if p == path:
            return hf
    layer = path[0].removeprefix("layers_")
    if path[1:3] == ("mlp", "experts"):
        return f"model.layers.{layer}.moe.{path[3]}.weight"
    if path[1:3] == ("mlp", "gate"):
        return f"model.layers.{layer}.moe.gate.weight"
    return f"model.layers.{layer}." + ".".join(path[1:])


def hf_tensors_from_params(params) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, array in HF layout) for every parameter: used to write checkpoints."""
    for path, arr in flatten(params).items():
        arr = np.asarray(arr)
        if is_stacked_expert(path):
            yield param_to_hf(path), np.ascontiguousarray(arr.transpose(0, 2, 1))
        else:
            yield param_to_hf(path), arr


def is_fp8_quantized(name: str) -> bool:
    """Which tensors a block-FP8 Step3 checkpoint stores in float8 (as written by the tiny writer):
    every projection matrix, including the stacked experts; not embeddings, lm_head, norms or router."""
    name = canonical_name(name)
    return (name.endswith("proj.weight") or name.endswith(".wq.weight")) and name.startswith("model.layers.")
