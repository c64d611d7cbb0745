"""A Model with random weights generated directly on the device (no checkpoint files),
for benchmarks at real shapes where writing and reading a checkpoint would dominate. The same
Model as ``moejax.load(path, load_format="dummy")`` (moejax/model.py ``random_weights_model``),
built from a config dict."""

from __future__ import annotations

from moejax.config import EngineConfig
from moejax.model import Model, random_weights_model
from moejax.models.registry import parse_model_config
from moejax.weights.random_params import random_device_params

__all__ = ["random_device_params", "random_model"]


def random_model(hf_config: dict, dtype: str = "bfloat16", parallel: str | None = None, seed: int = 0,
                 params=None, **engine_kw) -> Model:
    """``params``: reuse already generated weights (random_device_params of the same config and FP8
    policy). ``engine_kw``: the EngineConfig.create arguments (max_model_len, max_num_seqs, kernels,
    weight_dtype="fp8", ...). The tokenizer is the tiny byte-level one (moejax/tiny/tokenizer.py)."""
    config = EngineConfig.create(parse_model_config(hf_config), dtype=dtype, parallel=parallel,
                                 **{"max_model_len": 4096, **engine_kw})
    return random_weights_model(config, hf_config, seed=seed, params=params)
