#!/usr/bin/env python
"""Per-rank loads of an expert placement before and after balancing, for a recorded or synthetic load.

  python scripts/eplb_stats.py --experts 256 --ranks 8 --zipf 0.5 --clustered
  python scripts/eplb_stats.py --experts 64 --ranks 8 --zipf 1.0 --redundant 8
  python scripts/eplb_stats.py --load counts.npy --ranks 8       # [E] or [layers, E] token counts

Balancedness is mean over max tokens per rank (vLLM/SGLang); imbalance is its inverse.
"""

import argparse

import numpy as np

from moejax.eplb.placement import balanced_placement, balancedness, contiguous_placement, rank_loads, zipf_load


def report(load: np.ndarray, ranks: int, redundant: int, layer: str = "") -> None:
    before = rank_loads(load, contiguous_placement(len(load), ranks))
    plan = balanced_placement(load, ranks, redundant)
    after = rank_loads(load, plan)
    share = lambda r: " ".join(f"{x / r.mean():5.2f}" for x in r)  # noqa: E731
    print(f"{layer}contiguous: imbalance {1 / balancedness(before):.3f}   per-rank load / mean: {share(before)}")
    print(f"{layer}balanced:   imbalance {1 / balancedness(after):.3f}   per-rank load / mean: {share(after)}"
          + (f"   ({int((plan.num_replicas > 1).sum())} experts replicated)" if redundant else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", help=".npy or .txt of token counts per expert ([E] or [layers, E])")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--redundant", type=int, default=0, help="extra slots for replicas of hot experts")
    ap.add_argument("--zipf", type=float, default=0.8, help="Zipf exponent of the synthetic load")
    ap.add_argument("--clustered", action="store_true", help="hot experts next to each other (synthetic)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.load:
        load = np.load(a.load) if a.load.endswith(".npy") else np.loadtxt(a.load)
    else:
        load = zipf_load(a.experts, s=a.zipf, seed=a.seed, shuffle=not a.clustered)
    load = np.atleast_2d(load)
    for i, row in enumerate(load):
        report(row, a.ranks, a.redundant, f"layer {i}: " if len(load) > 1 else "")


if __name__ == "__main__":
    main()
