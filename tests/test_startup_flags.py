"""moejax/xla_flags.py: the CPU start-up flags only where JAX runs on the CPU, the user's XLA_FLAGS winning,
and nothing changed once a backend exists."""

import os
import subprocess
import sys
import warnings

from moejax import xla_flags


def test_cpu_flags_only_on_the_cpu_and_the_users_value_wins():
    cpu = xla_flags.wanted({"JAX_PLATFORMS": "cpu"})
    assert cpu["xla_backend_optimization_level"] == "0"
    assert set(xla_flags.FLAGS) <= set(cpu)
    gpu = xla_flags.wanted({"JAX_PLATFORMS": "cuda"})
    assert gpu == xla_flags.FLAGS  # no CPU-only flag reaches a GPU's compiles


def test_a_fresh_process_gets_them_and_the_users_value_wins():
    code = "import os; import moejax; print(os.environ['XLA_FLAGS'])"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=2")
    flags = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    assert flags.count("--xla_backend_optimization_level=2") == 1
    assert not any(f.startswith("--xla_backend_optimization_level=0") for f in flags)
    assert {f"--{k}={v}" for k, v in xla_flags.FLAGS.items()} <= set(flags)


def test_nothing_changes_once_a_backend_exists():
    import jax

    jax.devices()  # the test process's backend exists
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert xla_flags.set_xla_flags(env) == []
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8" and w
