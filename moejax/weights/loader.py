"""Load an HF DeepSeek checkpoint directory into a parameter pytree.

Every tensor is checked against the shapes the Flax model declares: missing,
unexpected or mis-shaped tensors raise a ValueError naming the HF tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.weights.checked_tensors import CheckedTensors, np_dtype
from moejax.weights.fp8 import dequantize_block_fp8
from moejax.weights.hf_names import flatten, hf_to_param, is_stacked_expert, param_to_hf, unflatten


def model_class(cfg):
    """The Flax module of a config's family: DeepseekForCausalLM or Step3ForCausalLM."""
    if getattr(cfg, "family", None) == "step3":
        from moejax.models.step3 import Step3ForCausalLM
        return Step3ForCausalLM
    from moejax.models.deepseek import DeepseekForCausalLM
    return DeepseekForCausalLM


def abstract_variables(cfg: ModelConfig, dtype: str):
    """Shapes and dtypes of the model's variables ("params", "routing"), without allocating them."""
    model = model_class(cfg)(cfg, jnp.dtype(dtype))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def abstract_params(cfg: ModelConfig, dtype: str):
    return abstract_variables(cfg, dtype)["params"]


def load_hf_params(directory: str, cfg: ModelConfig, dtype: str = "bfloat16", progress: bool = True):
    """Returns the parameter pytree as NumPy arrays (host memory)."""
    if getattr(cfg, "family", None) == "step3":  # own name table: moejax/weights/step3_names.py
        from moejax.weights.step3_loader import load_step3_params
        return load_step3_params(directory, cfg, dtype, progress)
    expected = flatten(abstract_params(cfg, dtype))
    tensors = CheckedTensors(directory, cfg)
    out: dict[tuple[str, ...], np.ndarray] = {}
    experts_seen: dict[tuple[str, ...], set[int]] = {}
    for name in tensors.names(progress):
        ref = hf_to_param(name)
        if ref is not None and ref.layer is not None and ref.layer >= cfg.num_hidden_layers:
            if ref.layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
                tensors.skip(name)
                continue  # multi-token-prediction layers: not used for decoding
        if ref is None or ref.path not in expected:
            raise ValueError(f"checkpoint tensor {name!r} is not a parameter of this {cfg.model_type} model")
        arr, scale = tensors.get(name)
        if scale is not None:
            arr = dequantize_block_fp8(arr, scale, cfg.fp8_block_size)
        want = expected[ref.path]
        dt = np_dtype(want)
        if is_stacked_expert(ref.path):
            per_expert = (want.shape[2], want.shape[1])  # HF [out, in]
            if tuple(arr.shape) != per_expert:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {per_expert}")
            if not 0 <= ref.expert < want.shape[0]:
                raise ValueError(f"checkpoint tensor {name!r}: expert index {ref.expert} >= n_routed_experts")
            if ref.path not in out:
                out[ref.path] = np.empty(want.shape, dt)
                experts_seen[ref.path] = set()
            out[ref.path][ref.expert] = np.asarray(arr, np.float32).T.astype(dt)
            experts_seen[ref.path].add(ref.expert)
        else:
            if tuple(arr.shape) != tuple(want.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want.shape)}")
            out[ref.path] = np.asarray(arr).astype(dt)
    tensors.finish()
    for path, want in expected.items():
        if path not in out:
            raise ValueError(f"checkpoint is missing tensor {param_to_hf(path, 0 if is_stacked_expert(path) else None)!r}")
        if is_stacked_expert(path) and len(experts_seen[path]) != want.shape[0]:
            e = min(set(range(want.shape[0])) - experts_seen[path])
            raise ValueError(f"checkpoint is missing tensor {param_to_hf(path, e)!r}")
    return unflatten(out)
