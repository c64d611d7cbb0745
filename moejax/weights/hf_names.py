"""The one table between HF checkpoint tensor names and moejax's parameter pytree.

Dense tensors keep HF's name and layout: ``model.layers.3.self_attn.q_a_proj.weight``
is ``params["layers_3"]["self_attn"]["q_a_proj"]["weight"]``. Routed experts are
the one exception: HF stores one [out, in] matrix per expert, moejax stacks them
as [E, in, out] for grouped GEMMs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Iterator, NamedTuple

import numpy as np

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_TOP = {
    "model.embed_tokens.weight": ("embed_tokens", "weight"),
    "model.norm.weight": ("norm", "weight"),
    "lm_head.weight": ("lm_head", "weight"),
}


class ParamRef(NamedTuple):
    path: tuple[str, ...]
    expert: int | None = None  # index on the stacked axis for routed experts
    layer: int | None = None


def hf_to_param(name: str) -> ParamRef | None:
    """Where an HF tensor goes, or None if the name is not a model weight we know."""
    if name in _TOP:
        return ParamRef(_TOP[name])
    m = _EXPERT.match(name)
    if m:
        layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        return ParamRef((f"layers_{layer}", "mlp", "experts", proj), e, layer)
    m = _LAYER.match(name)
    if m:
        return ParamRef((f"layers_{m.group(1)}", *m.group(2).split(".")), None, int(m.group(1)))
    return None


def param_to_hf(path: tuple[str, ...], expert: int | None = None) -> str:
    """Inverse of hf_to_param, for messages and for writing HF checkpoints."""
    for hf, p in _TOP.items():
        if p == path:
            return hf
    layer = path[0].removeprefix("layers_")
    if path[1:3] == ("mlp", "experts"):
        return f"model.layers.{layer}.mlp.experts.{expert if expert is not None else '*'}.{path[3]}.weight"
    return f"model.layers.{layer}." + ".".join(path[1:])


def is_stacked_expert(path: tuple[str, ...]) -> bool:
    return len(path) == 4 and path[1:3] == ("mlp", "experts")


def hf_tensors_from_params(params) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, array in HF layout) for every parameter: used to write checkpoints."""
    for path, arr in flatten(params).items():
        arr = np.asarray(arr)
        if is_stacked_expert(path):
            for e in range(arr.shape[0]):
                yield param_to_hf(path, e), np.ascontiguousarray(arr[e].T)
        else:
            yield param_to_hf(path), arr


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
