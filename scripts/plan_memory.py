#!/usr/bin/env python
"""Memory plan of a model on a parallel layout, from the model's own parameter shapes (nothing is
allocated): weights per GPU by layer type, then the KV cache that fits beside them, in tokens and
in sequences of a workload (input + output tokens each).

  python scripts/plan_memory.py --preset deepseek-v3 --parallel dp8-ep8 --weight-dtype fp8 --gpu-memory 141
  python scripts/plan_memory.py --preset deepseek-v3 --parallel dp8-ep8 --weight-dtype fp8 --gpu-memory 192
  python scripts/plan_memory.py --preset deepseek-v3 --weight-dtype fp8 --fp8-layers experts,shared_experts

Assumptions (printed): a fraction --gpu-memory-utilization of each GPU is usable (vLLM's default
0.9), of which --reserve-gb goes to activations, the step's buffers and the compiled programs; the
rest holds the weights and the KV cache. Under DP attention + EP experts each GPU holds its share of
the routed experts (E/N, plus redundant slots) and a full copy of everything else, and its own KV
cache for its own sequences. --concurrency says whether that workload fits (per node).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax.config import EngineConfig  # noqa: E402
from moejax.layers.kv_quant import cache_row_dim  # noqa: E402
from moejax.models.registry import abstract_params, parse_model_config  # noqa: E402
from moejax.parallel.config import ParallelConfig  # noqa: E402
from moejax.tiny.presets import PRESETS, preset  # noqa: E402
from moejax.weights.param_tree import flatten, layer_type  # noqa: E402

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
         fp8_layers: str = "default") -> dict:
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
    row = cache_row_dim(cfg.kv_cache_dim, kv_cache_dtype) * (1 if kv_cache_dtype == "fp8" else 2)
    per_token = cfg.num_hidden_layers * row
    tokens = max(int(kv_free // per_token), 0)
    seq_blocks = -(-(input_len + output_len) // block_size)
    seqs = tokens // (seq_blocks * block_size)
    return {"model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "ranks": n,
            "fp8_layers": sorted(fp8.kinds), "weights_gb_by_kind": {k: v / GB for k, v in sorted(per_gpu.items())},
            "weights_gb": weights / GB, "usable_gb": usable / GB, "kv_gb": max(kv_free, 0) / GB,
            "kv_bytes_per_token": per_token, "kv_tokens_per_gpu": tokens, "seqs_per_gpu": seqs,
            "seqs_per_node": seqs * n, "fits": kv_free > 0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    ap.add_argument("--parallel", default="dp8-ep8", help="a layout (dp{N}-ep{N}, a shipped name or a .yaml); 'none'")
    ap.add_argument("--weight-dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--fp8-layers", default="default",
                    help="layer types kept FP8 with --weight-dtype fp8, comma list (moejax/layers/fp8_policy.py)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--gpu-memory", type=float, default=141.0, help="GB per GPU (H200 141, MI300X 192)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--reserve-gb", type=float, default=6.0, help="activations, step buffers, programs (GB per GPU)")
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4096, help="the workload to check (sequences per node)")
    a = ap.parse_args(argv)
    r = plan(preset(a.preset), None if a.parallel == "none" else a.parallel, a.weight_dtype, a.gpu_memory,
             a.gpu_memory_utilization, a.reserve_gb, a.kv_cache_dtype, a.input_len, a.output_len,
             fp8_layers=a.fp8_layers)
    print(f"{a.preset} ({r['model_type']}, {r['layers']} layers), {a.parallel} ({r['ranks']} GPUs), "
          f"{a.weight_dtype} weights (FP8 layers: {', '.join(r['fp8_layers']) or 'none'}), "
          f"KV cache {a.kv_cache_dtype}")
    print(f"GPU: {a.gpu_memory:g} GB x {a.gpu_memory_utilization:g} usable, {a.reserve_gb:g} GB reserved for "
          f"activations/buffers -> {r['usable_gb']:.1f} GB for weights + KV cache")
    print("weights per GPU:")
    for k, v in r["weights_gb_by_kind"].items():
        print(f"  {k:<15} {v:8.2f} GB")
    print(f"  {'total':<15} {r['weights_gb']:8.2f} GB")
    if not r["fits"]:
        print(f"does NOT fit: the weights exceed the usable memory by {r['weights_gb'] - r['usable_gb']:.1f} GB")
        return 1
    print(f"KV cache per GPU: {r['kv_gb']:.1f} GB = {r['kv_tokens_per_gpu']:,} tokens "
          f"({r['kv_bytes_per_token']:,} bytes a token over all layers)")
    print(f"sequences of {a.input_len} + {a.output_len} tokens: {r['seqs_per_gpu']:,} per GPU, "
          f"{r['seqs_per_node']:,} per node")
    ok = r["seqs_per_node"] >= a.concurrency
    print(f"concurrency {a.concurrency}: {'fits' if ok else 'does NOT fit'} (largest that fits: {r['seqs_per_node']:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
