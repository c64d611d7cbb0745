"""``moejax.load`` / ``moejax.save`` and the Model they return."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

from moejax.config import EngineConfig
from moejax.engine.llm_engine import LLMEngine
from moejax.engine.model_runner import ModelRunner
from moejax.eplb.balancer import ExpertLoadBalancer, initial_placements, physical_params, routing_tree
from moejax.kernel_selection import KernelScopedModule
from moejax.models.registry import abstract_params, build_module, parse_model_config
from moejax.parallel.sharding import make_mesh, shard_params
from moejax.tokenizer import Tokenizer
from moejax.weights.loader import load_hf_params
from moejax.weights.orbax_io import restore_params, save_params

MARKER = "moejax.json"  # present in directories written by moejax.save
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Model:
    """A loaded model: its EngineConfig, parameters on device, tokenizer, and (lazily) an engine."""

    def __init__(self, config: EngineConfig, hf_config: dict, params, tokenizer: Tokenizer, source_dir: str):
        self.config, self.hf_config = config, hf_config
        self.tokenizer, self.source_dir = tokenizer, source_dir
        # Expert placement: contiguous, plus replicas in the redundant slots (moejax/eplb/).
        self.placements = initial_placements(config.model, config.num_ranks, config.num_redundant_experts)
        if config.num_redundant_experts:
            params = physical_params(params, self.placements)
        if config.parallel is None:
            self.mesh = None
            self.params = jax.device_put(params)
        else:
            self.mesh = make_mesh(config.num_ranks)
            self.params = shard_params(params, self.mesh)
        self.routing = jax.device_put(routing_tree(self.placements, 1 + config.num_redundant_experts))
        # Pallas or XLA kernels, picked at trace time (moejax/kernel_selection.py).
        self.module = KernelScopedModule(build_module(config.model, config.dtype, config.expert_parallel),
                                         config.kernels)
        self._engine = None

    # Short names for what callers read most.
    dtype = property(lambda self: self.config.dtype)
    max_model_len = property(lambda self: self.config.scheduler.max_model_len)
    block_size = property(lambda self: self.config.cache.block_size)

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            runner = ModelRunner(self.config, self.module, self.params, self.routing, self.mesh)
            balancer = ExpertLoadBalancer(self.config, runner, self.placements)
            cfg_eos = self.config.model.eos_token_ids
            eos = cfg_eos or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
            self._engine = LLMEngine(self.config, runner, self.tokenizer, eos, balancer)
        return self._engine

    def score(self, token_ids) -> np.ndarray:
        """Full-vocabulary logits of each prompt: float32 array [B, T, V]. Prompts must have equal length."""
        arr = _as_token_matrix(token_ids, self.config.model.vocab_size)
        if arr.shape[1] > self.max_model_len:
            raise ValueError(f"token_ids has length {arr.shape[1]} > max_model_len {self.max_model_len}")
        return self.engine.runner.score(arr)


def _as_token_matrix(token_ids, vocab_size: int) -> np.ndarray:
    try:
        arr = np.asarray(token_ids)
    except ValueError as e:
        raise ValueError(f"token_ids must be a rectangular [B, T] array of token ids: {e}") from None
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.size == 0 or arr.dtype == object:
        raise ValueError("token_ids must be a non-empty [B, T] array of token ids (all prompts of equal length)")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"token_ids must lie in [0, {vocab_size})")
    return arr.astype(np.int32)


def load(path: str, dtype: str = "bfloat16", *, parallel: str | None = None, max_model_len: int | None = None,
         max_num_seqs: int = 256, block_size: int = 16, num_kv_blocks: int | None = None,
         max_prefill_tokens: int = 8192, progress: bool = True, kv_cache_dtype: str = "auto",
         kernels: str = "auto") -> Model:
    """Loads an HF checkpoint directory of a registered family (DeepSeek-V2/V3, Step3), or one
    written by ``moejax.save``.

    ``parallel`` names a layout ("dp8-ep8": DP attention + EP experts over 8 devices, any N; or a
    layout shipped in configs/) or a path to one; without it the model runs on one device.
    max_num_seqs and num_kv_blocks are per data-parallel rank. ``kv_cache_dtype``: "auto" (the
    model dtype) or "fp8" (e4m3 rows with a per-row scale, DeepSeek MLA only). ``kernels``:
    "auto" (Pallas on GPU, XLA on CPU), "pallas" or "xla". Every argument is checked by
    ``EngineConfig.create`` (moejax/config.py).
    """
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"path {path!r} is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path} has no config.json")
    with open(cfg_path) as f:
        hf_config = json.load(f)
    config = EngineConfig.create(parse_model_config(hf_config), dtype=dtype, parallel=parallel,
                                 max_model_len=max_model_len, max_num_seqs=max_num_seqs, block_size=block_size,
                                 num_kv_blocks=num_kv_blocks, max_prefill_tokens=max_prefill_tokens,
                                 kv_cache_dtype=kv_cache_dtype, kernels=kernels)
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            saved_dtype = json.load(f)["dtype"]
        params = restore_params(path, abstract_params(config.model, saved_dtype))
        if saved_dtype != dtype:  # the router stays float32 whatever the model dtype
            params = jax.tree.map(lambda a, t: a.astype(t.dtype), params, abstract_params(config.model, dtype))
    else:
        params = load_hf_params(path, config.model, dtype, progress)
    return Model(config, hf_config, params, Tokenizer(path), path)


def save(model: Model, directory: str) -> None:
    """Writes converted weights (orbax), config.json and the tokenizer; ``load`` reads it back."""
    os.makedirs(directory, exist_ok=True)
    save_params(jax.device_get(model.params), directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.hf_config, f, indent=2)
    for fn in _TOKENIZER_FILES:
        src = os.path.join(model.source_dir, fn)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(directory, fn)):
            shutil.copy(src, os.path.join(directory, fn))
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump({"format_version": 1, "dtype": model.dtype}, f)
