"""Random weights shaped like a model, made on the device (no checkpoint files): what
``moejax.load(..., load_format="dummy")`` and ``moejax.model.random_model`` run on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.layers.linear import SCALE_SUFFIX
from moejax.weights.param_tree import flatten, unflatten


def _leaf_kind(path: tuple[str, ...], dtype) -> str:
    name = path[-2] if path[-1] == "weight" else path[-1]
    if name.endswith("norm"):
        return "ones"
    if name == "e_score_correction_bias":
        return "zeros"
    if path[-1].endswith(SCALE_SUFFIX):
        return "scale"
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        return "e4m3"
    return "normal"


@functools.lru_cache(maxsize=512)
def _maker(kind: str, shape: tuple[int, ...], dtype, std: float, sharding):
    """One compiled program per kind of leaf, shape and sharding (a model's layers share them)."""
    def make(key):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        if kind == "scale":
            return jnp.full(shape, std / 112.0, dtype)
        x = jax.random.normal(key, shape, jnp.float32)
        if kind == "e4m3":
            return jnp.clip(112.0 * x, -448, 448).astype(jnp.float8_e4m3fn)
        return (std * x).astype(dtype)
    return jax.jit(make, out_shardings=sharding)


def random_device_params(abstract, seed: int = 0, std: float = 0.02, shardings=None):
    """Random weights made on the device, shaped like ``abstract``: the ShapeDtypeStruct tree the model
    declares (``moejax.models.registry.abstract_params(cfg, dtype, fp8)``; passed in, so this module knows
    no model). FP8 leaves: e4m3 codes of about std 112 with block scales std / 112, i.e. weights of std
    ``std``. ``shardings``: a pytree of the same structure giving each leaf's sharding (each device makes
    only its own shards: ``ParamPlacer.restore_shardings``); None: every leaf on the default device. The
    values do not depend on the shardings."""
    leaves = flatten(abstract)
    where = flatten(shardings) if shardings is not None else {}
    key = jax.random.key(seed)
    out = {}
    for i, (path, leaf) in enumerate(leaves.items()):
        make = _maker(_leaf_kind(path, leaf.dtype), tuple(leaf.shape), jnp.dtype(leaf.dtype), float(std),
                      where.get(path))
        out[path] = make(jax.random.fold_in(key, i))
    return unflatten(out)
