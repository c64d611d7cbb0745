import os

# Tests run on the CPU; EP tests ask for 8 host devices. Set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402

from moejax.tiny.presets import preset  # noqa: E402


def rel_err(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """HF-written tiny checkpoints of both families, with their torch reference models."""
    from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
    out = {}
    # Initialiser std 0.1 spreads the logits so greedy near-ties are rare; the bf16
    # checks use HF's default 0.02, where bf16 rounding seldom flips a routing choice.
    for name, cfg in {
        "v3": preset("v3-tiny", initializer_range=0.1),
        "v2": preset("v2-lite-tiny", initializer_range=0.1),
        "v3-std": preset("v3-tiny"),
        "v2-std": preset("v2-lite-tiny"),
    }.items():
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, make_hf_checkpoint(d, cfg, seed=1))
    return out
