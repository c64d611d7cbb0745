"""The embedded default model: a tiny random-weight DeepSeek-V3-architecture checkpoint,
built on first use in a cache directory. Its output is meaningless text."""

from __future__ import annotations

import os

from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

DEFAULT_DIR = os.path.join(os.path.expanduser(os.environ.get("MOEJAX_CACHE", "~/.cache/moejax")), "tiny-random-v3")


def default_model_path() -> str:
    if not os.path.exists(os.path.join(DEFAULT_DIR, "config.json")):
        make_random_checkpoint(DEFAULT_DIR, preset("v3-tiny"), seed=0, std=0.1)
    return DEFAULT_DIR
