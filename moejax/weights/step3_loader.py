"""Load an HF Step3 checkpoint directory (text model, or the text part of Step3-VL).

As for DeepSeek, every tensor is checked against the shapes the Flax model
declares; missing, unexpected, duplicated or mis-shaped tensors raise a
ValueError naming the HF tensor. FP8 block-scaled tensors (``*_scale_inv``) are
dequantised on load, including the stacked [E, out, in] experts (scales
[E, ceil(out/bo), ceil(in/bi)]).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from moejax.weights.fp8 import dequantize_block_fp8
from moejax.weights.hf_names import flatten, unflatten
from moejax.weights.safetensors_io import CheckpointReader
from moejax.weights.step3_names import hf_to_param, is_vision_tensor, param_to_hf

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_FP8 = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)


def _dequant(name, weight, scale_inv, block):
    try:
        return dequantize_block_fp8(weight, scale_inv, block)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def load_step3_params(directory: str, cfg, dtype: str = "bfloat16", progress: bool = True):
    """Returns the parameter pytree as NumPy arrays (host memory)."""
    from moejax.weights.loader import abstract_params
    expected = flatten(abstract_params(cfg, dtype))
    files = CheckpointReader(directory)
    tensor = files.get

    out: dict[tuple[str, ...], np.ndarray] = {}
    source: dict[tuple[str, ...], str] = {}
    names = [n for n in files if not n.endswith("_scale_inv")]
    scale_names = {n for n in files if n.endswith("_scale_inv")}
    used_scales = set()
    for name in tqdm(names, desc="Loading weights", unit="tensor", disable=not progress):
        if is_vision_tensor(name):
            used_scales.add(name + "_scale_inv")
            continue  # vision tower / projector: only the text model is built
        ref = hf_to_param(name)
        if ref is None or ref.path not in expected:
            raise ValueError(f"checkpoint tensor {name!r} is not a parameter of this {cfg.model_type} model")
        if ref.path in source:
            raise ValueError(f"checkpoint tensors {source[ref.path]!r} and {name!r} are the same parameter")
        source[ref.path] = name
        arr = tensor(name)
        fp8 = arr.dtype in _FP8
        if fp8:
            sname = name + "_scale_inv"
            if sname not in files:
                raise ValueError(f"checkpoint tensor {name!r} is float8 but {sname!r} is missing")
            if cfg.fp8_block_size is None:
                raise ValueError(f"checkpoint tensor {name!r} is float8 but config.json has no quantization_config")
            scale = tensor(sname)
            used_scales.add(sname)
        want = expected[ref.path]
        np_dtype = _NP_DTYPES.get(str(want.dtype), np.float32)
        if ref.stacked:
            E, I_in, O = want.shape  # stored [E, in, out]; HF [E, out, in]
            if tuple(arr.shape) != (E, O, I_in):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {(E, O, I_in)}")
            if fp8 and (scale.ndim != 3 or scale.shape[0] != E):
                raise ValueError(f"checkpoint tensor {sname!r} has shape {tuple(scale.shape)}: expected one "
                                 f"[rows, cols] block-scale grid per expert ({E} experts)")
            buf = np.empty(want.shape, np_dtype)
            for e in range(E):  # one expert at a time: never the whole tensor in float32
                w = _dequant(name, arr[e], scale[e], cfg.fp8_block_size) if fp8 else np.asarray(arr[e], np.float32)
                buf[e] = w.T.astype(np_dtype)
            out[ref.path] = buf
        else:
            if fp8:
                if arr.ndim != 2:
                    raise ValueError(f"checkpoint tensor {name!r} is float8 but not a matrix")
                arr = _dequant(name, arr, scale, cfg.fp8_block_size)
            if tuple(arr.shape) != tuple(want.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want.shape)}")
            out[ref.path] = np.asarray(arr).astype(np_dtype)
    unused = sorted(scale_names - used_scales)
    if unused:
        raise ValueError(f"checkpoint tensor {unused[0]!r} scales a tensor that is not float8 or not present")
    for path in expected:
        if path not in out:
            raise ValueError(f"checkpoint is missing tensor {param_to_hf(path)!r}")
    return unflatten(out)
