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


def restore_params(directory: str, abstract):
    """NumPy arrays in host memory (the caller places them: ParamPlacer transfers each process's own
    shards), never the whole model on one device. The zero-filled targets only name shapes and dtypes
    (calloc'd pages, untouched until orbax fills them)."""
    path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target)
