"""config.json contents for random-weight models of every family (tiny ones and the real
shapes); each family's module (moejax/models/) owns its presets, this looks them up."""

from __future__ import annotations

import copy

from moejax.models.registry import family_for, presets

PRESETS = presets()


def with_layers(cfg: dict, n: int) -> dict:
    """The same model with n layers, the first dense and the rest MoE."""
    if n < 1:
        raise ValueError(f"layers must be >= 1, got {n}")
    return family_for(cfg["model_type"]).with_layers(cfg, n)


def preset(name: str, **overrides) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[name])
    cfg.update(overrides)
    return cfg
