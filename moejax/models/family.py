"""What a model family gives the shared engine: one ``ModelFamily`` per family module.

A family module (moejax/models/deepseek.py, step3.py) owns its config parsing, its Flax
model, its HF-name table and the presets of its tiny random checkpoints; it ends with a
``FAMILY = ModelFamily(...)`` that moejax/models/registry.py lists once. Everything else
(loader, checkpoint writer, runner, EP sharding, EPLB, server) reads a family only
through these fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from moejax.weights.param_tree import ParamRef


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values this family reads
    parse_config: Callable[[dict], Any]  # config.json dict -> the family's frozen config dataclass
    causal_lm: type  # Flax module, constructed as causal_lm(cfg, dtype, expert_parallel)
    # The HF-name table. hf_to_param: name -> ParamRef, or None for a name this family does not know.
    hf_to_param: Callable[[str], ParamRef | None]
    # Inverse, for messages and for writing checkpoints; ``expert`` picks one expert's tensor.
    param_to_hf: Callable[[tuple[str, ...], int | None], str]
    # Routed experts on disk: one [out, in] tensor per expert, or all in one [E, out, in] tensor.
    experts_stacked_on_disk: bool
    # Which HF tensors an FP8 block-scaled checkpoint stores in float8 (projections, not norms/router).
    is_fp8_quantized: Callable[[str], bool]
    presets: dict[str, dict]  # name -> config.json of a (tiny or real-shaped) random model
    with_layers: Callable[[dict, int], dict]  # the same config with n layers, the first dense
    # Leaves made of several HF tensors stacked along ``out`` (one GEMM for projections of the same input):
    # (cfg, leaf path) -> ((HF tensor's own path, its rows), ...) in order, or None for a leaf of one tensor.
    # The loader concatenates the parts (FP8: their block scales too); the checkpoint writer splits them.
    fused_parts: Callable[[Any, tuple[str, ...]], tuple[tuple[tuple[str, ...], int], ...] | None] = \
        lambda cfg, path: None
    # Tensors the checkpoint holds but the model does not build (a vision tower).
    ignores: Callable[[str, Any], bool] = lambda name, cfg: False
    # A checkpoint tensor the model shares with another instead of storing it (DeepSeek's MTP layer's
    # embed_tokens: the main embedding): (name, cfg) -> the tensor it must equal, or None. The loader
    # refuses the checkpoint when the two differ.
    shared_tensor: Callable[[str, Any], str | None] = lambda name, cfg: None
    # config.json contents fitted to the checkpoint's tensor names before parsing (hf_config, names) ->
    # (hf_config, a message to show or None): DeepSeek drops an MTP layer the checkpoint lacks altogether.
    fit_config: Callable[[dict, Any], tuple[dict, str | None]] = lambda hf_config, names: (hf_config, None)
    # A random checkpoint's final tensors (cfg, HF tensors, seed, dtype) -> tensors: e.g. a VL wrapper's
    # name prefix and vision-tower stand-ins.
    add_checkpoint_extras: Callable[[Any, dict, int, Any], dict] = lambda cfg, tensors, seed, dtype: tensors
    fp8_kv_cache: bool = True  # the attention reads FP8 cache rows (kernels/kv_quant.py)
    # transformers classes (config, model) by model_type, for reference checkpoints; {} = none exist.
    transformers_classes: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

