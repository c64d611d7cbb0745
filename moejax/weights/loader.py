"""Load an HF checkpoint directory of any registered family into a parameter pytree.

The family's name table (moejax/models/<family>.py) says where each HF tensor goes;
this loader checks every tensor against the shapes the Flax model declares: missing,
unexpected, duplicated or mis-shaped tensors raise a ValueError naming the HF tensor.
Routed experts arrive one [out, in] tensor per expert (DeepSeek) or one [E, out, in]
tensor (Step3) and are stored [E, in, out]. FP8 block-scaled tensors are dequantised on
load, one expert at a time (never a whole stacked tensor in float32).
"""

from __future__ import annotations

import numpy as np

from moejax.models.registry import abstract_params, family_of
from moejax.weights.checked_tensors import CheckedTensors, np_dtype
from moejax.weights.fp8 import dequantize_block_fp8
from moejax.weights.param_tree import flatten, is_stacked_expert, unflatten


def _matrix(name: str, arr, scale, block) -> np.ndarray:
    """One [out, in] matrix in float32 (dequantised when it comes with block scales)."""
    if scale is None:
        return np.asarray(arr, np.float32)
    if arr.ndim != 2:
        raise ValueError(f"checkpoint tensor {name!r} is float8 but not a matrix")
    try:
        return dequantize_block_fp8(arr, scale, block)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _check_shape(name: str, arr, want: tuple) -> None:
    if tuple(arr.shape) != tuple(want):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want)}")


def load_hf_params(directory: str, cfg, dtype: str = "bfloat16", progress: bool = True):
    """Returns the parameter pytree as NumPy arrays (host memory)."""
    family = family_of(cfg)
    expected = flatten(abstract_params(cfg, dtype))
    tensors = CheckedTensors(directory, cfg)
    block = cfg.fp8_block_size
    out: dict[tuple[str, ...], np.ndarray] = {}
    source: dict[tuple, str] = {}  # (path, expert) -> the HF name that filled it
    for name in tensors.names(progress):
        if family.ignores(name, cfg):
            tensors.skip(name)
            continue
        ref = family.hf_to_param(name)
        if ref is None or ref.path not in expected:
            raise ValueError(f"checkpoint tensor {name!r} is not a parameter of this {cfg.model_type} model")
        if (ref.path, ref.expert) in source:
            raise ValueError(f"checkpoint tensors {source[ref.path, ref.expert]!r} and {name!r} are the same parameter")
        source[ref.path, ref.expert] = name
        arr, scale = tensors.get(name)
        want = expected[ref.path]
        dt = np_dtype(want)
        if ref.expert is not None:  # one expert: HF [out, in] -> row ref.expert of [E, in, out]
            E, n_in, n_out = want.shape
            _check_shape(name, arr, (n_out, n_in))
            if not 0 <= ref.expert < E:
                raise ValueError(f"checkpoint tensor {name!r}: expert index {ref.expert} >= n_routed_experts")
            buf = out.setdefault(ref.path, np.empty(want.shape, dt))
            buf[ref.expert] = _matrix(name, arr, scale, block).T.astype(dt)
        elif ref.stacked:  # all experts: HF [E, out, in] -> [E, in, out]
            E, n_in, n_out = want.shape
            _check_shape(name, arr, (E, n_out, n_in))
            if scale is not None and (scale.ndim != 3 or scale.shape[0] != E):
                raise ValueError(f"checkpoint tensor {name + '_scale_inv'!r} has shape {tuple(scale.shape)}: "
                                 f"expected one [rows, cols] block-scale grid per expert ({E} experts)")
            buf = np.empty(want.shape, dt)
            for e in range(E):
                buf[e] = _matrix(name, arr[e], None if scale is None else scale[e], block).T.astype(dt)
            out[ref.path] = buf
        else:
            arr = _matrix(name, arr, scale, block) if scale is not None else arr
            _check_shape(name, arr, want.shape)
            out[ref.path] = np.asarray(arr).astype(dt)
    tensors.finish()
    experts_seen: dict[tuple[str, ...], set] = {}
    for path, e in source:
        experts_seen.setdefault(path, set()).add(e)
    for path, want in expected.items():
        per_expert = is_stacked_expert(path) and not family.experts_stacked_on_disk
        if path not in out:
            raise ValueError(f"checkpoint is missing tensor {family.param_to_hf(path, 0 if per_expert else None)!r}")
        if per_expert:
            missing = sorted(set(range(want.shape[0])) - experts_seen[path])
            if missing:
                raise ValueError(f"checkpoint is missing tensor {family.param_to_hf(path, missing[0])!r}")
    return unflatten(out)
