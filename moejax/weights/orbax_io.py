"""Converted weights saved/restored with orbax-checkpoint, so a restart skips
HF conversion (and FP8 dequantisation)."""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

PARAMS_DIR = "params"


def save_params(params, directory: str) -> None:
    """Across processes every process calls it with the same global arrays and writes its own shards."""
    path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params, force=True)


def restore_params(directory: str, abstract, shardings=None):
    """Each leaf straight to its sharding (a tree like ``abstract``: every process reads only its own
    shards), or, without ``shardings``, NumPy arrays in host memory for the caller to place (ParamPlacer),
    never the whole model on one device. Zero-filled NumPy targets only name shapes and dtypes (calloc'd
    pages, untouched until orbax fills them)."""
    path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    if shardings is None:
        target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    else:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target)
