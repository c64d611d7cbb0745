"""Writes random-weight HF-layout DeepSeek checkpoints with NumPy alone (no torch),
so the embedded default model can be built on any machine. The weights are
random: the model produces meaningless text."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from moejax.config import ModelConfig
from moejax.tiny.tokenizer import write_tokenizer
from moejax.weights.fp8 import quantize_block_fp8
from moejax.weights.hf_names import flatten, hf_tensors_from_params
from moejax.weights.safetensors_io import save_safetensors

FP8_BLOCK = (128, 128)


def fp8_quantization_config() -> dict:
    """The config.json entry of a DeepSeek-V3-style FP8 block-scaled checkpoint."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
    """A random parameter pytree (float32 NumPy) shaped like the model."""
    from moejax.weights.loader import abstract_params
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
    from moejax.weights.hf_names import unflatten
    return unflatten(out)


def is_fp8_quantized(name: str) -> bool:
    """Which tensors DeepSeek-V3 stores in float8: the projection matrices, not the
    embeddings, lm_head, norms or router."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def quantize_tensors(tensors: dict[str, np.ndarray], block=FP8_BLOCK) -> dict[str, np.ndarray]:
    out = {}
    for name, arr in tensors.items():
        if is_fp8_quantized(name):
            q, s = quantize_block_fp8(np.asarray(arr, np.float32), block)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = arr
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
                           fp8: bool = False, max_shard_bytes: int | None = None, std: float = 0.02) -> str:
    if hf_config.get("model_type") in ("step3_text", "step3_vl"):  # Step3: its own name table
        from moejax.tiny.step3_checkpoint import make_random_step3_checkpoint
        return make_random_step3_checkpoint(directory, hf_config, seed, dtype, fp8, max_shard_bytes, std)
    hf_config = dict(hf_config)
    cfg = ModelConfig.from_dict(hf_config)
    params = random_params(cfg, seed, std)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in hf_tensors_from_params(params)}
    if fp8:
        tensors = quantize_tensors(tensors)
        hf_config["quantization_config"] = fp8_quantization_config()
    hf_config["torch_dtype"] = dtype
    write_checkpoint(directory, hf_config, tensors, max_shard_bytes)
    return directory
