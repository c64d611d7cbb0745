"""Load an HF Step3 checkpoint directory (text model, or the text part of Step3-VL).

As for DeepSeek, every tensor is checked against the shapes the Flax model
declares; missing, unexpected, duplicated or mis-shaped tensors raise a
ValueError naming the HF tensor. FP8 block-scaled tensors (``*_scale_inv``) are
dequantised on load, including the stacked [E, out, in] experts (scales
[E, ceil(out/bo), ceil(in/bi)]).
"""

from __future__ import annotations

import numpy as np

from moejax.weights.checked_tensors import CheckedTensors, np_dtype
from moejax.weights.fp8 import dequantize_block_fp8
from moejax.weights.hf_names import flatten, unflatten
from moejax.weights.step3_names import hf_to_param, is_vision_tensor, param_to_hf


def _dequant(name, weight, scale_inv, block):
    try:
        return dequantize_block_fp8(weight, scale_inv, block)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def load_step3_params(directory: str, cfg, dtype: str = "bfloat16", progress: bool = True):
    """Returns the parameter pytree as NumPy arrays (host memory)."""
    from moejax.weights.loader import abstract_params
    expected = flatten(abstract_params(cfg, dtype))
    tensors = CheckedTensors(directory, cfg)
    out: dict[tuple[str, ...], np.ndarray] = {}
    source: dict[tuple[str, ...], str] = {}
    for name in tensors.names(progress):
        if is_vision_tensor(name):
            tensors.skip(name)
            continue  # vision tower / projector: only the text model is built
        ref = hf_to_param(name)
        if ref is None or ref.path not in expected:
            raise ValueError(f"checkpoint tensor {name!r} is not a parameter of this {cfg.model_type} model")
        if ref.path in source:
            raise ValueError(f"checkpoint tensors {source[ref.path]!r} and {name!r} are the same parameter")
        source[ref.path] = name
        arr, scale = tensors.get(name)
        fp8 = scale is not None
        want = expected[ref.path]
        dt = np_dtype(want)
        if ref.stacked:
            E, I_in, O = want.shape  # stored [E, in, out]; HF [E, out, in]
            if tuple(arr.shape) != (E, O, I_in):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {(E, O, I_in)}")
            if fp8 and (scale.ndim != 3 or scale.shape[0] != E):
                raise ValueError(f"checkpoint tensor {name + '_scale_inv'!r} has shape {tuple(scale.shape)}: "
                                 f"expected one [rows, cols] block-scale grid per expert ({E} experts)")
            buf = np.empty(want.shape, dt)
            for e in range(E):  # one expert at a time: never the whole tensor in float32
                w = _dequant(name, arr[e], scale[e], cfg.fp8_block_size) if fp8 else np.asarray(arr[e], np.float32)
                buf[e] = w.T.astype(dt)
            out[ref.path] = buf
        else:
            if fp8:
                if arr.ndim != 2:
                    raise ValueError(f"checkpoint tensor {name!r} is float8 but not a matrix")
                arr = _dequant(name, arr, scale, cfg.fp8_block_size)
            if tuple(arr.shape) != tuple(want.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want.shape)}")
            out[ref.path] = np.asarray(arr).astype(dt)
    tensors.finish()
    for path in expected:
        if path not in out:
            raise ValueError(f"checkpoint is missing tensor {param_to_hf(path)!r}")
    return unflatten(out)
