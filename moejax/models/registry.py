"""The model families, by ``model_type``: the one place a family is listed.

A new family is one module in moejax/models/ ending in ``FAMILY = ModelFamily(...)``
(moejax/models/family.py says what it provides) plus its line in ``FAMILIES`` below.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from moejax.json_file import load_json_file
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.models import deepseek, step3
from moejax.models.family import ModelFamily
from moejax.models.hf_config import bad
from moejax.parallel.dispatch import ExpertParallel

FAMILIES: tuple[ModelFamily, ...] = (
    deepseek.FAMILY,
    step3.FAMILY,
)

_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)


def family_for(model_type: str) -> ModelFamily:
    if model_type not in _BY_MODEL_TYPE:
        raise bad("model_type", model_type, f"supported model types are {list(SUPPORTED_MODEL_TYPES)}")
    return _BY_MODEL_TYPE[model_type]


def family_of(cfg: Any) -> ModelFamily:
    """The family of a parsed config."""
    return family_for(cfg.model_type)


def parse_model_config(d: dict[str, Any]):
    """config.json contents -> the family's config (DeepseekConfig, Step3Config, ...)."""
    if not isinstance(d, dict):
        raise ValueError(f"config.json must hold an object, got {type(d).__name__}")
    return family_for(d.get("model_type")).parse_config(d)


def load_model_config(path: str):
    """The config of a checkpoint directory (or of a config.json path)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{os.path.dirname(path) or path} has no config.json")
    return parse_model_config(load_json_file(path, "config.json"))


def build_module(cfg: Any, dtype: str, ep: ExpertParallel = ExpertParallel(), fp8: Fp8Policy = NO_FP8):
    """The family's Flax causal LM for this config (``fp8``: which layer types keep FP8 weights)."""
    return family_of(cfg).causal_lm(cfg, jnp.dtype(dtype), ep, fp8)


def abstract_variables(cfg: Any, dtype: str, fp8: Fp8Policy = NO_FP8):
    """Shapes and dtypes of the model's variables ("params", "routing"), without allocating them."""
    model = build_module(cfg, dtype, fp8=fp8)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def abstract_params(cfg: Any, dtype: str, fp8: Fp8Policy = NO_FP8):
    return abstract_variables(cfg, dtype, fp8)["params"]


def presets() -> dict[str, dict]:
    """Every family's presets (config.json contents of random-weight models), by name."""
    return {name: p for f in FAMILIES for name, p in f.presets.items()}
