"""The memory plan of a model on a parallel layout, from its parameter shapes (nothing allocated): weights
per GPU by layer type and the KV cache beside them, in tokens and in sequences of a workload. Used by
``scripts/plan_memory.py`` (which prints it) and ``scripts/project_node.py`` (which projects only
concurrencies that fit)."""

from __future__ import annotations

import collections
import functools
import json

import numpy as np

from moejax.config import EngineConfig
from moejax.kernels.kv_quant import cache_row_dim
from moejax.models.registry import abstract_params, parse_model_config
from moejax.parallel.config import ParallelConfig
from moejax.weights.param_tree import flatten, layer_type

GB = 1e9


@functools.lru_cache(maxsize=None)
def _param_bytes(hf_json: str, weight_dtype: str, fp8_layers: str) -> tuple:
    """(path, bytes) of every parameter, from the model's abstract shapes: tracing a 61-layer model takes
    seconds, and one model is planned on several layouts."""
    cfg = parse_model_config(json.loads(hf_json))
    fp8 = EngineConfig.create(cfg, weight_dtype=weight_dtype, fp8_layers=fp8_layers).fp8
    return tuple((path, int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize)
                 for path, leaf in flatten(abstract_params(cfg, "bfloat16", fp8)).items())


def plan(hf: dict, parallel: str | None, weight_dtype: str, gpu_memory_gb: float, utilization: float,
         reserve_gb: float, kv_cache_dtype: str, input_len: int, output_len: int, block_size: int = 16,
         fp8_layers: str = "default", cache_row: int | None = None) -> dict:
    """``cache_row``: a cache row's width in elements where it is not kv_quant's (the engine's own rule,
    decode_tables.cache_row_dim, depends on the device it runs on: 640 for DeepSeek-V3's FP8 rows where the
    Mosaic GPU kernel reads them)."""
    cfg = parse_model_config(hf)
    pc = ParallelConfig.load(parallel) if parallel else None
    n = pc.num_ranks if pc else 1
    redundant = pc.num_redundant_experts if pc else 0
    fp8 = EngineConfig.create(cfg, weight_dtype=weight_dtype, fp8_layers=fp8_layers).fp8
    per_gpu: dict[str, float] = collections.defaultdict(float)
    for path, nbytes in _param_bytes(json.dumps(hf, sort_keys=True), weight_dtype, fp8_layers):
        kind = layer_type(path)
        if kind == "experts":  # E/N (+ redundant slots) per GPU
            nbytes = nbytes * (cfg.n_routed_experts + redundant) / cfg.n_routed_experts / n
        per_gpu[kind] += nbytes
    weights = sum(per_gpu.values())
    usable = gpu_memory_gb * GB * utilization - reserve_gb * GB
    kv_free = usable - weights
    row = (cache_row or cache_row_dim(cfg.kv_cache_dim, kv_cache_dtype)) * (1 if kv_cache_dtype == "fp8" else 2)
    per_token = cfg.num_hidden_layers * row
    tokens = max(int(kv_free // per_token), 0)
    seq_blocks = -(-(input_len + output_len) // block_size)
    seqs = tokens // (seq_blocks * block_size)
    return {"model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "ranks": n,
            "fp8_layers": sorted(fp8.kinds), "weights_gb_by_kind": {k: v / GB for k, v in sorted(per_gpu.items())},
            "weights_gb": weights / GB, "usable_gb": usable / GB, "kv_gb": max(kv_free, 0) / GB,
            "kv_bytes_per_token": per_token, "kv_tokens_per_gpu": tokens, "seqs_per_gpu": seqs,
            "seqs_per_node": seqs * n, "fits": kv_free > 0}
