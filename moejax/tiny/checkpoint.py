"""Writes random-weight HF-layout checkpoints of any registered family with NumPy alone
(no torch), so the embedded default model can be built on any machine. The weights are
random: the model produces meaningless text."""

from __future__ import annotations

import json
import os
from typing import Iterator

import ml_dtypes
import numpy as np

from moejax.models.family import ModelFamily
from moejax.models.registry import abstract_params, family_of, parse_model_config
from moejax.tiny.tokenizer import write_tokenizer
from moejax.weights.fp8 import quantize_block_fp8
from moejax.weights.param_tree import flatten, is_stacked_expert, unflatten
from moejax.weights.safetensors_io import save_safetensors

FP8_BLOCK = (128, 128)
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def fp8_quantization_config(block=FP8_BLOCK) -> dict:
    """The config.json entry of a DeepSeek-V3-style FP8 block-scaled checkpoint."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def random_params(cfg, seed: int = 0, std: float = 0.02) -> dict:
    """A random parameter pytree (float32 NumPy) shaped like the model."""
    rng = np.random.default_rng(seed)
    out = {}
    for path, leaf in flatten(abstract_params(cfg, "float32")).items():
        name = path[-2] if path[-1] == "weight" else path[-1]
        if name.endswith("norm"):
            arr = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif name == "e_score_correction_bias":
            arr = 0.05 * rng.standard_normal(leaf.shape)
        else:
            arr = std * rng.standard_normal(leaf.shape)
        out[path] = arr.astype(np.float32)
    return unflatten(out)


def hf_tensors_from_params(params, family: ModelFamily, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, array in HF layout) for every parameter, through the family's name table;
    a fused leaf (``family.fused_parts``) is split back into its HF tensors."""
    for path, arr in flatten(params).items():
        arr = np.asarray(arr)
        parts = family.fused_parts(cfg, path)
        if parts:
            if arr.shape[0] != sum(rows for _, rows in parts):
                raise ValueError(f"parameter {'/'.join(path)} has {arr.shape[0]} rows, its parts "
                                 f"{[family.param_to_hf(p, None) for p, _ in parts]} {sum(r for _, r in parts)}")
            for (part, _), a in zip(parts, np.split(arr, np.cumsum([r for _, r in parts])[:-1])):
                yield family.param_to_hf(part, None), np.ascontiguousarray(a)
        elif not is_stacked_expert(path):
            yield family.param_to_hf(path, None), arr
        elif family.experts_stacked_on_disk:  # [E, in, out] -> one [E, out, in] tensor
            yield family.param_to_hf(path, None), np.ascontiguousarray(arr.transpose(0, 2, 1))
        else:  # one [out, in] tensor per expert
            for e in range(arr.shape[0]):
                yield family.param_to_hf(path, e), np.ascontiguousarray(arr[e].T)


def quantize_tensors(tensors: dict[str, np.ndarray], is_fp8_quantized, block=FP8_BLOCK) -> dict[str, np.ndarray]:
    """Block-FP8 the tensors the family stores in float8; a stacked [E, out, in] tensor gets
    scales [E, rows, cols]."""
    out = {}
    for name, arr in tensors.items():
        if not is_fp8_quantized(name):
            out[name] = arr
            continue
        arr = np.asarray(arr, np.float32)
        if arr.ndim == 3:
            qs = [quantize_block_fp8(a, block) for a in arr]
            out[name], out[name + "_scale_inv"] = np.stack([q for q, _ in qs]), np.stack([s for _, s in qs])
        else:
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(arr, block)
    return out


def write_checkpoint(directory: str, hf_config: dict, tensors: dict[str, np.ndarray],
                     max_shard_bytes: int | None = None) -> None:
    """Writes config.json, safetensors shards (with an index when sharded) and the tokenizer."""
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, arr in tensors.items():
        if current and max_shard_bytes and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += arr.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_safetensors(shards[0], os.path.join(directory, "model.safetensors"), {"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors(shard, os.path.join(directory, fn), {"format": "pt"})
            weight_map.update({k: fn for k in shard})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                       "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_tokenizer(directory)


def make_random_checkpoint(directory: str, hf_config: dict, seed: int = 0, dtype: str = "float32",
                           fp8: bool = False, max_shard_bytes: int | None = None, std: float = 0.02,
                           fp8_block=FP8_BLOCK) -> str:
    """A random-weight checkpoint of ``hf_config``'s family, in that family's HF names and layout.
    ``fp8_block``: the [rows, cols] weight blocks of an ``fp8`` one (DeepSeek-V3's 128x128 by default)."""
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_NP_DTYPES)}, got {dtype!r}")
    hf_config = dict(hf_config)
    cfg = parse_model_config(hf_config)
    family = family_of(cfg)
    np_dtype = _NP_DTYPES[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in hf_tensors_from_params(random_params(cfg, seed, std), family, cfg)}
    if fp8:
        tensors = quantize_tensors(tensors, family.is_fp8_quantized, tuple(fp8_block))
        hf_config["quantization_config"] = fp8_quantization_config(fp8_block)
    tensors = family.add_checkpoint_extras(cfg, tensors, seed, np_dtype)
    hf_config["torch_dtype"] = dtype
    write_checkpoint(directory, hf_config, tensors, max_shard_bytes)
    return directory
