"""Random-weight HF-layout Step3 checkpoints written with NumPy (transformers has no Step3 class).

Text configs ("step3_text") get the published text-model names; a "step3_vl"
config gets them under ``language_model.`` plus a few vision-tower tensors, as a
vision-language checkpoint carries (the loader ignores those).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moejax.tiny.checkpoint import FP8_BLOCK, fp8_quantization_config, random_params, write_checkpoint
from moejax.weights.fp8 import quantize_block_fp8
from moejax.weights.step3_names import hf_tensors_from_params, is_fp8_quantized

VL_PREFIX = "language_model."


def quantize_step3_tensors(tensors: dict[str, np.ndarray], block=FP8_BLOCK) -> dict[str, np.ndarray]:
    """Block-FP8 every projection; stacked experts [E, out, in] get scales [E, rows, cols]."""
    out = {}
    for name, arr in tensors.items():
        if not is_fp8_quantized(name):
            out[name] = arr
            continue
        arr = np.asarray(arr, np.float32)
        if arr.ndim == 3:
            qs = [quantize_block_fp8(a, block) for a in arr]
            out[name] = np.stack([q for q, _ in qs])
            out[name + "_scale_inv"] = np.stack([s for _, s in qs])
        else:
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(arr, block)
    return out


def vision_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A few stand-ins for the Step3-VL vision tower and projector (names as published)."""
    return {
        "vision_model.embeddings.patch_embedding.weight": rng.standard_normal((8, 3, 4, 4)).astype(np.float32),
        "vision_model.transformer.layers.0.self_attn.qkv_proj.weight": rng.standard_normal((24, 8)).astype(np.float32),
        "vit_downsampler.weight": rng.standard_normal((8, 8, 2, 2)).astype(np.float32),
        "vit_large_projector.weight": rng.standard_normal((16, 8)).astype(np.float32),
    }


def make_random_step3_checkpoint(directory: str, hf_config: dict, seed: int = 0, dtype: str = "float32",
                                 fp8: bool = False, max_shard_bytes: int | None = None, std: float = 0.02) -> str:
    from moejax.models.step3_config import parse_step3_config
    hf_config = dict(hf_config)
    cfg = parse_step3_config(hf_config)
    params = random_params(cfg, seed, std)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in hf_tensors_from_params(params)}
    if fp8:
        tensors = quantize_step3_tensors(tensors)
        hf_config["quantization_config"] = fp8_quantization_config()
    if cfg.model_type == "step3_vl":
        tensors = {VL_PREFIX + k: v for k, v in tensors.items()}
        tensors.update({k: v.astype(np_dtype) for k, v in vision_tensors(np.random.default_rng(seed)).items()})
    hf_config["torch_dtype"] = dtype
    write_checkpoint(directory, hf_config, tensors, max_shard_bytes)
    return directory
