"""Converted weights saved/restored with orbax-checkpoint, so a restart skips
HF conversion (and FP8 dequantisation)."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

PARAMS_DIR = "params"


def save_params(params, directory: str) -> None:
    path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params, force=True)


def restore_params(directory: str, abstract):
    path = os.path.abspath(os.path.join(directory, PARAMS_DIR))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target)
