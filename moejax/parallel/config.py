"""Parallel layout read from ``configs/<name>.yaml`` (or a path to such a file)."""

from __future__ import annotations

import dataclasses
import os

import yaml

from moejax.parallel.dispatch import BACKENDS

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
_FIELDS = {"data_parallel_size", "expert_parallel_size", "moe_backend", "num_redundant_experts",
           "eplb_interval", "eplb_window"}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    name: str
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    moe_backend: str = "a2a"
    num_redundant_experts: int = 0  # extra expert slots for replicas of hot experts
    eplb_interval: int = 0  # rebalance every N engine steps; 0 = off
    eplb_window: int = 1000  # steps of expert counts the balancer looks at

    @property
    def num_ranks(self) -> int:
        return self.data_parallel_size

    @classmethod
    def load(cls, spec: str) -> "ParallelConfig":
        path = spec if os.path.sep in spec or spec.endswith((".yaml", ".yml")) else os.path.join(CONFIG_DIR, spec + ".yaml")
        if not os.path.exists(path):
            names = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) if os.path.isdir(CONFIG_DIR) else []
            raise ValueError(f"parallel config {spec!r} not found (known names: {names})")
        with open(path) as f:
            d = yaml.safe_load(f) or {}
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        pc = cls(name=os.path.splitext(os.path.basename(path))[0], **d)
        for f, lo in (("data_parallel_size", 1), ("expert_parallel_size", 1), ("num_redundant_experts", 0),
                      ("eplb_interval", 0), ("eplb_window", 1)):
            v = getattr(pc, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{path}: {f} must be an integer >= {lo}, got {v!r}")
        if pc.data_parallel_size != pc.expert_parallel_size:
            raise ValueError(f"{path}: data_parallel_size must equal expert_parallel_size (one mesh axis serves both)")
        if pc.moe_backend not in BACKENDS:
            raise ValueError(f"{path}: moe_backend must be one of {BACKENDS}, got {pc.moe_backend!r}")
        return pc
