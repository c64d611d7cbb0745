"""A Model with random weights generated directly on the device (no checkpoint files),
for benchmarks at real shapes where writing and reading a checkpoint would dominate."""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp

from moejax.config import EngineConfig
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.layers.linear import SCALE_SUFFIX
from moejax.model import Model, ParamPlacer
from moejax.models.registry import abstract_params, parse_model_config
from moejax.tiny.tokenizer import write_tokenizer
from moejax.tokenizer import Tokenizer
from moejax.weights.param_tree import flatten, unflatten


def random_device_params(cfg, dtype: str, seed: int = 0, std: float = 0.02, fp8: Fp8Policy = NO_FP8):
    """Random weights made on the device, shaped like the model (FP8 leaves: e4m3 codes of about
    std 112 with block scales std / 112, i.e. weights of std ``std``)."""
    leaves = flatten(abstract_params(cfg, dtype, fp8))
    key = jax.random.key(seed)
    out = {}
    for i, (path, leaf) in enumerate(leaves.items()):
        name = path[-2] if path[-1] == "weight" else path[-1]
        k = jax.random.fold_in(key, i)
        if name.endswith("norm"):
            out[path] = jnp.ones(leaf.shape, leaf.dtype)
        elif name == "e_score_correction_bias":
            out[path] = jnp.zeros(leaf.shape, leaf.dtype)
        elif path[-1].endswith(SCALE_SUFFIX):
            out[path] = jnp.full(leaf.shape, std / 112.0, leaf.dtype)
        elif jnp.dtype(leaf.dtype) == jnp.dtype(jnp.float8_e4m3fn):
            out[path] = jax.jit(lambda k, s=leaf.shape: jnp.clip(112.0 * jax.random.normal(k, s, jnp.float32),
                                                                 -448, 448).astype(jnp.float8_e4m3fn))(k)
        else:
            out[path] = jax.jit(lambda k, s=leaf.shape, d=leaf.dtype: (std * jax.random.normal(k, s, jnp.float32)).astype(d))(k)
    return unflatten(out)


def random_model(hf_config: dict, dtype: str = "bfloat16", parallel: str | None = None, seed: int = 0,
                 params=None, **engine_kw) -> Model:
    """``params``: reuse already generated weights (random_device_params of the same config and FP8
    policy). ``engine_kw``: the EngineConfig.create arguments (max_model_len, max_num_seqs, kernels,
    weight_dtype="fp8", ...)."""
    cfg = parse_model_config(hf_config)
    config = EngineConfig.create(cfg, dtype=dtype, parallel=parallel, **{"max_model_len": 4096, **engine_kw})
    tmp = tempfile.mkdtemp(prefix="moejax-tok-")
    write_tokenizer(tmp)
    if params is None:
        params = random_device_params(cfg, dtype, seed, fp8=config.fp8)
    placer = ParamPlacer(config)
    return Model(config, hf_config, placer.tree(params), Tokenizer(tmp), tmp, placer)
