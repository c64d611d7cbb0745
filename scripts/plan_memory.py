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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax.benchmark.memory_plan import plan  # noqa: E402
from moejax.tiny.presets import PRESETS, preset  # noqa: E402


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
    ap.add_argument("--cache-row-dim", type=int, default=None,
                    help="a cache row's width in elements where it is not kv_quant's (the engine's rule, "
                         "decode_tables.cache_row_dim: 640 for DeepSeek-V3's FP8 rows where the Hopper Mosaic GPU "
                         "MLA kernel reads them; 592 elsewhere)")
    a = ap.parse_args(argv)
    r = plan(preset(a.preset), None if a.parallel == "none" else a.parallel, a.weight_dtype, a.gpu_memory,
             a.gpu_memory_utilization, a.reserve_gb, a.kv_cache_dtype, a.input_len, a.output_len,
             fp8_layers=a.fp8_layers, cache_row=a.cache_row_dim)
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
