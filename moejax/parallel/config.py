"""Parallel layouts: ``ParallelConfig.load(spec)``.

``spec`` is one of

- ``dp{N}-ep{N}`` (any N >= 1, both numbers equal): generated here with the defaults, no file
  (moe_backend a2a, no EPLB);
- the name of a layout shipped with the package (the repository's top-level ``configs/``, installed
  as the package data ``moejax/configs/*.yaml``), e.g. ``dp8-ep8-eplb``, the example that
  documents every field;
- a path to a YAML file (it contains a path separator or ends in ``.yaml``/``.yml``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from pathlib import Path

import yaml

from moejax.parallel.dispatch import BACKENDS, DBO_MODES

GENERATED_PATTERN = "dp{N}-ep{N}"
_GENERATED = re.compile(r"dp([1-9][0-9]*)-ep([1-9][0-9]*)")
_FIELDS = {"data_parallel_size", "expert_parallel_size", "moe_backend", "num_redundant_experts",
           "eplb_interval", "eplb_window", "dbo", "dbo_decode_min_tokens", "dbo_prefill_min_tokens"}
_SUFFIXES = (".yaml", ".yml")


def layout_dir():
    """Where the shipped layouts are: ``moejax/configs`` in an installed wheel (read through
    importlib.resources), else the repository's ``configs/`` next to the package (a source
    tree, or an editable install, whose ``moejax`` is the repository's)."""
    installed = importlib.resources.files("moejax").joinpath("configs")
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "configs"


def shipped_layouts() -> dict:
    """Shipped layout name -> resource (a Traversable with read_text)."""
    d = layout_dir()
    if not d.is_dir():
        return {}
    return {f.name.rsplit(".", 1)[0]: f for f in d.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES)}


def _is_path(spec: str) -> bool:
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return any(s in spec for s in seps) or spec.endswith(_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    name: str
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    moe_backend: str = "a2a"
    num_redundant_experts: int = 0  # extra expert slots for replicas of hot experts
    eplb_interval: int = 0  # rebalance every N engine steps; 0 = off
    eplb_window: int = 1000  # steps of expert counts the balancer looks at
    # Dual-batch overlap: "auto" (by tokens per rank, below), "on", "off". Off by default: on one node the
    # split costs more than it hides (docs/dbo.md: +23-27% per-rank compute against an exchange of 3-6%
    # of the step); "auto" is for layouts whose exchange is large (several nodes).
    dbo: str = "off"
    dbo_decode_min_tokens: int = 64  # "auto" splits decode steps of at least this many tokens per rank
    dbo_prefill_min_tokens: int = 512  # ... and prefill steps of at least this many

    @property
    def num_ranks(self) -> int:
        return self.data_parallel_size

    @classmethod
    def load(cls, spec) -> "ParallelConfig":
        spec = os.fspath(spec)
        m = _GENERATED.fullmatch(spec)
        if m and m.group(1) == m.group(2):
            n = int(m.group(1))
            return cls._checked(spec, spec, dict(data_parallel_size=n, expert_parallel_size=n))
        if _is_path(spec):
            if not os.path.isfile(spec):
                raise ValueError(f"parallel layout file {spec!r} not found")
            with open(spec) as f:
                text = f.read()
            where, name = spec, os.path.splitext(os.path.basename(spec))[0]
        else:
            shipped = shipped_layouts()
            if spec not in shipped:
                known = ", ".join(sorted(shipped)) or f"none found in {layout_dir()}"
                hint = (f" (in {GENERATED_PATTERN} both numbers are the same N >= 1)"
                        if re.fullmatch(r"dp[0-9]+-ep[0-9]+", spec) else "")
                raise ValueError(f"parallel layout {spec!r} not found{hint}; known: {GENERATED_PATTERN} for any "
                                 f"N >= 1 (generated, e.g. dp8-ep8), the shipped layouts ({known}), or a path "
                                 f"to a .yaml file")
            text, where, name = shipped[spec].read_text(), str(shipped[spec]), spec
        d = yaml.safe_load(text) or {}
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping of fields, got {type(d).__name__}")
        return cls._checked(name, where, d)

    @classmethod
    def _checked(cls, name: str, where: str, d: dict) -> "ParallelConfig":
        unknown = sorted(set(d) - _FIELDS, key=str)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        if isinstance(d.get("dbo"), bool):  # YAML 1.1 reads a bare on / off as a boolean
            d = {**d, "dbo": "on" if d["dbo"] else "off"}
        pc = cls(name=name, **d)
        for f, lo in (("data_parallel_size", 1), ("expert_parallel_size", 1), ("num_redundant_experts", 0),
                      ("eplb_interval", 0), ("eplb_window", 1), ("dbo_decode_min_tokens", 2),
                      ("dbo_prefill_min_tokens", 2)):
            v = getattr(pc, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{where}: {f} must be an integer >= {lo}, got {v!r}")
        if pc.data_parallel_size != pc.expert_parallel_size:
            raise ValueError(f"{where}: data_parallel_size must equal expert_parallel_size (one mesh axis serves both)")
        if pc.dbo not in DBO_MODES:
            raise ValueError(f"{where}: dbo must be one of {DBO_MODES}, got {pc.dbo!r}")
        if pc.moe_backend not in BACKENDS:
            raise ValueError(f"{where}: moe_backend must be one of {BACKENDS}, got {pc.moe_backend!r}")
        return pc
