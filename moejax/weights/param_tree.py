"""The parameter pytree and how an HF tensor name points into it.

Parameters are a plain nested dict that keeps HF's module names and [out, in] layout:
``model.layers.3.self_attn.q_a_proj.weight`` is ``params["layers_3"]["self_attn"]["q_a_proj"]["weight"]``.
Routed experts are the one exception in every family: they are stacked as
``layers_N/mlp/experts/{gate,up,down}_proj`` [E, in, out] for grouped GEMMs. Each
family's module (moejax/models/) maps its HF names onto this tree with ``ParamRef``s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

# HF's names of the tensors outside the decoder layers, the same in every family here.
TOP_LEVEL = {
    "model.embed_tokens.weight": ("embed_tokens", "weight"),
    "model.norm.weight": ("norm", "weight"),
    "lm_head.weight": ("lm_head", "weight"),
}
TOP_LEVEL_NAME = {path: name for name, path in TOP_LEVEL.items()}


def default_hf_name(path: tuple[str, ...]) -> str:
    """HF's name of a parameter stored under its own module path (everything but routed experts):
    ``layers_3/self_attn/q_a_proj/weight`` -> ``model.layers.3.self_attn.q_a_proj.weight``."""
    if path in TOP_LEVEL_NAME:
        return TOP_LEVEL_NAME[path]
    return f"model.layers.{path[0].removeprefix('layers_')}." + ".".join(path[1:])


class ParamRef(NamedTuple):
    """Where one HF tensor goes: a leaf path, and for routed experts how HF stores them."""
    path: tuple[str, ...]
    expert: int | None = None  # one expert's [out, in] matrix, at this index of the stacked axis
    layer: int | None = None
    stacked: bool = False  # all experts in one [E, out, in] tensor


def is_stacked_expert(path: tuple[str, ...]) -> bool:
    return len(path) == 4 and path[1:3] == ("mlp", "experts")


def flatten(tree, prefix=()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def layer_type(path: tuple[str, ...]) -> str:
    """The layer type of a parameter, in the FP8 policy's words (moejax/layers/fp8_policy.py) plus
    "embedding", "router", "norm" and "mtp_proj" (a DeepSeek MTP layer's eh_proj; its shared_head's
    head is an "lm_head"): for memory plans and byte counts."""
    if path[0] == "embed_tokens":
        return "embedding"
    if path[0] == "lm_head" or path[1:3] == ("shared_head", "head"):
        return "lm_head"
    if path[1:2] == ("eh_proj",):
        return "mtp_proj"
    if "norm" in path[-2] or path[0] == "norm":
        return "norm"
    if path[1] == "self_attn":
        return "attention"
    if is_stacked_expert(path):
        return "experts"
    if path[1:3] == ("mlp", "gate"):
        return "router"
    if path[1] == "share_expert" or path[1:3] == ("mlp", "shared_experts"):
        return "shared_experts"
    return "dense_mlp"
