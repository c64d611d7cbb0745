"""``moejax.load`` / ``moejax.save`` and the Model they return."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.layers.kv_quant import cache_row_dim, cache_storage_dtype
from moejax.tokenizer import Tokenizer

MARKER = "moejax.json"  # present in directories written by moejax.save
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES = ("bfloat16", "float32")


class Model:
    """A loaded model: config, parameters on device, tokenizer, and (lazily) an engine."""

    def __init__(self, config: ModelConfig, hf_config: dict, params, tokenizer: Tokenizer, dtype: str,
                 source_dir: str, *, max_model_len: int, max_num_seqs: int, block_size: int,
                 num_kv_blocks: int | None, max_prefill_tokens: int, parallel=None, kv_cache_dtype: str = "auto",
                 kernels: str = "auto"):
        from moejax.layers.moe import ExpertParallel
        from moejax.parallel.sharding import AXIS, make_mesh, shard_params
        from moejax.eplb.balancer import initial_placements, physical_params, routing_tree
        self.config, self.hf_config = config, hf_config
        self.tokenizer, self.dtype, self.source_dir = tokenizer, dtype, source_dir
        self.parallel = parallel
        n_ranks = parallel.num_ranks if parallel else 1
        n_redundant = parallel.num_redundant_experts if parallel else 0
        self.placements = initial_placements(config, n_ranks, n_redundant)
        if n_redundant:
            params = physical_params(params, self.placements)
        if parallel is None:
            self.mesh, ep = None, ExpertParallel()
            self.params = jax.device_put(params)
        else:
            if config.n_routed_experts % parallel.num_ranks:
                raise ValueError(f"parallel {parallel.name!r}: n_routed_experts={config.n_routed_experts} is not "
                                 f"divisible by expert_parallel_size={parallel.expert_parallel_size}")
            if parallel.moe_backend == "ragged" and jax.default_backend() == "cpu":
                raise ValueError("moe_backend 'ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU does not "
                                 "implement; use 'a2a' or 'replicated' on CPU")
            self.mesh = make_mesh(parallel.num_ranks)
            ep = ExpertParallel(parallel.moe_backend, AXIS, parallel.num_ranks, n_redundant)
            self.params = shard_params(params, self.mesh)
        self.routing = jax.device_put(routing_tree(self.placements, 1 + n_redundant))
        from moejax.weights.loader import model_class  # DeepSeek or Step3, by config type
        self.module = model_class(config)(config, jnp.dtype(dtype), ep)
        from moejax.kernels.selection import KernelScopedModule  # Pallas or XLA kernels, picked at trace time
        self.kernels, self.kv_cache_dtype = kernels, kv_cache_dtype
        self.module = KernelScopedModule(self.module, kernels)
        self.max_model_len, self.max_num_seqs, self.block_size = max_model_len, max_num_seqs, block_size
        self.num_kv_blocks, self.max_prefill_tokens = num_kv_blocks, max_prefill_tokens
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            from moejax.engine.llm_engine import LLMEngine
            from moejax.engine.model_runner import ModelRunner
            n = self.num_kv_blocks or default_num_blocks(self)
            runner = ModelRunner(self.module, self.params, self.routing, n, self.block_size, self.max_model_len,
                                 self.max_num_seqs, cache_storage_dtype(self.kv_cache_dtype, self.dtype), self.mesh)
            from moejax.eplb.balancer import ExpertLoadBalancer
            pc = self.parallel
            runner.eplb = ExpertLoadBalancer(runner, self.placements, pc.num_redundant_experts if pc else 0,
                                             pc.eplb_interval if pc else 0, pc.eplb_window if pc else 1000,
                                             1 + (pc.num_redundant_experts if pc else 0))
            eos = self.config.eos_token_ids or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
            self._engine = LLMEngine(runner, self.tokenizer, eos, self.max_prefill_tokens)
        return self._engine

    def score(self, token_ids) -> np.ndarray:
        """Full-vocabulary logits of each prompt: float32 array [B, T, V]. Prompts must have equal length."""
        arr = _as_token_matrix(token_ids, self.config.vocab_size)
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


def default_num_blocks(model: Model) -> int:
    """KV blocks: all of max_num_seqs at max_model_len, capped by free device memory."""
    cfg = model.config
    row_bytes = (cache_row_dim(cfg.kv_cache_dim, model.kv_cache_dtype)
                 * cache_storage_dtype(model.kv_cache_dtype, model.dtype).itemsize)
    per_block = cfg.num_hidden_layers * model.block_size * row_bytes
    per_seq = -(-model.max_model_len // model.block_size)
    want = model.max_num_seqs * per_seq
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        budget = int(0.9 * stats["bytes_limit"]) - stats.get("bytes_in_use", 0) - (2 << 30)
    else:
        budget = 2 << 30  # host memory: keep the cache modest
    n = min(want, max(budget // per_block, 0))
    if n < per_seq:
        raise ValueError(f"not enough memory for one sequence of max_model_len={model.max_model_len}: "
                         "lower max_model_len or pass num_kv_blocks")
    return int(n)


def load(path: str, dtype: str = "bfloat16", *, parallel: str | None = None, max_model_len: int | None = None,
         max_num_seqs: int = 256, block_size: int = 16, num_kv_blocks: int | None = None,
         max_prefill_tokens: int = 8192, progress: bool = True, kv_cache_dtype: str = "auto",
         kernels: str = "auto") -> Model:
    """Loads an HF DeepSeek-V2/V3 checkpoint directory, or one written by ``moejax.save``.

    ``parallel`` names a layout under configs/ (e.g. "dp8-ep8") or a path to one; without
    it the model runs on one device. max_num_seqs and num_kv_blocks are per data-parallel rank.
    ``kv_cache_dtype``: "auto" (the model dtype) or "fp8" (e4m3 rows with a per-row scale,
    DeepSeek MLA only). ``kernels``: "auto" (Pallas on GPU, XLA on CPU), "pallas" or "xla".
    """
    from moejax.parallel.config import ParallelConfig
    pc = ParallelConfig.load(parallel) if parallel is not None else None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    from moejax.kernels.selection import check_mode
    check_mode(kernels)
    cache_row_dim(1, kv_cache_dtype)  # validates kv_cache_dtype
    if not os.path.isdir(path):
        raise ValueError(f"path {path!r} is not a directory")
    for name, v, lo in (("max_num_seqs", max_num_seqs, 1), ("block_size", block_size, 1),
                        ("max_prefill_tokens", max_prefill_tokens, 1)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path} has no config.json")
    with open(cfg_path) as f:
        hf_config = json.load(f)
    config = ModelConfig.from_dict(hf_config)
    if kv_cache_dtype == "fp8" and getattr(config, "model_type", "") not in ("deepseek_v2", "deepseek_v3"):
        raise ValueError("kv_cache_dtype='fp8' is implemented for DeepSeek MLA caches only")
    if max_model_len is None:
        max_model_len = min(config.max_position_embeddings, 4096)
    if not isinstance(max_model_len, int) or not 2 <= max_model_len <= config.max_position_embeddings:
        raise ValueError(f"max_model_len must be an integer in [2, {config.max_position_embeddings}], got {max_model_len!r}")
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):
        from moejax.weights.loader import abstract_params
        from moejax.weights.orbax_io import restore_params
        with open(marker) as f:
            saved_dtype = json.load(f)["dtype"]
        params = restore_params(path, abstract_params(config, saved_dtype))
        if saved_dtype != dtype:  # the router stays float32 whatever the model dtype
            params = jax.tree.map(lambda a, t: a.astype(t.dtype), params, abstract_params(config, dtype))
    else:
        from moejax.weights.loader import load_hf_params
        params = load_hf_params(path, config, dtype, progress)
    return Model(config, hf_config, params, Tokenizer(path), dtype, path, max_model_len=max_model_len,
                 max_num_seqs=max_num_seqs, block_size=block_size, num_kv_blocks=num_kv_blocks,
                 max_prefill_tokens=max_prefill_tokens, parallel=pc, kv_cache_dtype=kv_cache_dtype, kernels=kernels)


def save(model: Model, directory: str) -> None:
    """Writes converted weights (orbax), config.json and the tokenizer; ``load`` reads it back."""
    from moejax.weights.orbax_io import save_params
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
