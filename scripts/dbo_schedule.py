#!/usr/bin/env python
"""The dp{N}-ep{N} decode step as XLA compiles it, with dual-batch overlap on and off: its schedule
(what runs between each all-to-all's start and done) and its per-rank time.

  # one H200 standing in for 8 (JAX's mock GPU topology: 8 devices, 1 local, collectives mocked)
  python scripts/dbo_schedule.py --mock-topology 1x8x1 --preset deepseek-v3 --layers 4 --batch 64,256
  # 8 CPU host devices (the schedule only: XLA:CPU runs collectives synchronously)
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/dbo_schedule.py --preset v3-tiny --batch 8

--batch is tokens per rank. Weights, cache and step inputs are made on each device by jitted
initialisers (no host copy of the whole model, which under a mock topology no process could hold):
random weights, every sequence at --ctx tokens. With --mock-topology the collectives move nothing:
the time is the rank's compute with the exchange's latency hidden or not, which is what DBO changes
on the compute side; routing reads whatever the mocked all-to-all leaves in its buffers (a
per-rank compute estimate, not a node measurement). The compiled HLO of each variant is written
to --dump.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--layers", type=int, default=4, help="layer count (first dense, the rest MoE)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--batch", default="64,256", help="comma list of decode tokens per rank")
    p.add_argument("--ctx", type=int, default=2000, help="context length of every sequence")
    p.add_argument("--backend", default="a2a")
    # The engine's own spelling of these (flag, default, choices, help): moejax/engine_args.py. Importing
    # it imports jax but starts no backend, so --mock-topology still applies in main.
    from moejax.engine_args import EngineArgs
    EngineArgs.add_cli_args(p, only=("dtype", "kernels"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mock-topology", default=None, help="JAX's jax_mock_gpu_topology, e.g. 1x8x1 (GPU only)")
    p.add_argument("--dump", default=None, help="directory for the compiled HLO of each variant")
    p.add_argument("--dbo", default="off,on", help="comma list of the variants to compile and time")
    p.add_argument("--json", default=None)
    p.add_argument("--watchdog", type=float, default=0, help="print every thread's stack after this many seconds")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- schedule analysis
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")


def entry_schedule(hlo_text: str) -> list[tuple[str, str, str]]:
    """(name, opcode, line) of the entry computation's instructions in schedule order (a scheduled
    module lists them in the order they run)."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            m = _OP.match(line)
            if m:
                lines.append((m.group(1), m.group(3), line))
    return lines


def _is_a2a(line: str) -> bool:
    return "all-to-all" in line


def _is_kernel(opcode: str) -> bool:
    return opcode in ("fusion", "custom-call", "convolution", "dot", "sort", "scatter", "gather")


def _label(line: str) -> str:
    """A kernel's readable name: the JAX op_name of its metadata (Flax module path), else its HLO name."""
    m = re.search(r'op_name="([^"]+)"', line)
    if m:
        parts = [p for p in m.group(1).split("/") if p and not p.startswith(("jit(", "shard_map", "pjit"))]
        return "/".join(parts[-3:])
    return line.split("=")[0].strip()


def overlap_report(hlo_text: str) -> list[dict]:
    """For each asynchronous all-to-all (a start and its done): the kernels scheduled between them."""
    sched = entry_schedule(hlo_text)
    starts = {}
    pairs = []
    for i, (name, opcode, line) in enumerate(sched):
        if opcode in ("all-to-all-start", "async-start") and _is_a2a(line):
            starts[name] = i
        elif opcode in ("all-to-all-done", "async-done"):  # its operand names the start (if any) it ends
            src = next((s for s in starts if re.search(rf"%?{re.escape(s)}\b", line.split("(", 1)[1])), None)
            if src is None:
                continue
            j = starts.pop(src)
            between = [_label(ln) for _, op, ln in sched[j + 1:i] if _is_kernel(op)]
            pairs.append({"start": src, "kernels_between": len(between), "between": between})
    return pairs


def count_a2a(hlo_text: str) -> dict:
    sched = entry_schedule(hlo_text)
    return {"sync": sum(op == "all-to-all" for _, op, _ in sched),
            "async": sum(op in ("all-to-all-start", "async-start") and _is_a2a(ln) for _, op, ln in sched)}


# ----------------------------------------------------------------------------- the program
_WEIGHTS = {}


def build(a, dbo: str, batch: int):
    """The runner of a dp{N}-ep{N} layout (dbo forced on or off) with weights, cache and one decode
    step's inputs made on the devices. Returns (runner, params, routing, step arrays, sampling arrays)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from moejax.config import EngineConfig
    from moejax.engine.model_runner import ModelRunner
    from moejax.eplb.balancer import initial_placements, routing_tree
    from moejax.kernels.common import KernelScopedModule
    from moejax.models.registry import abstract_params, build_module, parse_model_config
    from moejax.parallel.sharding import RANK, REPLICATED, param_specs
    from moejax.tiny.presets import preset, with_layers

    cfg = parse_model_config(with_layers(preset(a.preset), a.layers))
    d = tempfile.mkdtemp(prefix="moejax-dbo-")
    layout = os.path.join(d, f"dp{a.ranks}-dbo-{dbo}.yaml")
    with open(layout, "w") as f:
        f.write(f"data_parallel_size: {a.ranks}\nexpert_parallel_size: {a.ranks}\nmoe_backend: {a.backend}\n"
                f"dbo: '{dbo}'\n")
    bs = 16
    nb = -(-(a.ctx + 1) // bs)
    config = EngineConfig.create(cfg, dtype=a.dtype, parallel=layout, kernels=a.kernels, max_model_len=nb * bs,
                                 max_num_seqs=batch, num_kv_blocks=batch * nb, block_size=bs)
    from moejax.parallel.sharding import make_mesh
    mesh = make_mesh(config.num_ranks)
    abstract = abstract_params(cfg, a.dtype, config.fp8)
    specs = param_specs(abstract)
    key = jax.random.key(0)

    def init(i, leaf, s):
        def make():
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                return (0.02 * jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)).astype(leaf.dtype)
            return jnp.zeros(leaf.shape, leaf.dtype)
        return jax.jit(make, out_shardings=NamedSharding(mesh, s))()

    if "params" not in _WEIGHTS:  # the same weights for every variant (one compile per leaf, once)
        flat_leaves, treedef = jax.tree.flatten(abstract)
        flat_specs = treedef.flatten_up_to(specs)
        _WEIGHTS["params"] = treedef.unflatten([init(i, leaf, s)
                                                for i, (leaf, s) in enumerate(zip(flat_leaves, flat_specs))])
    params = _WEIGHTS["params"]
    placements = initial_placements(cfg, config.num_ranks, 0)
    routing = jax.tree.map(lambda x: jax.jit(lambda: jnp.asarray(x), out_shardings=NamedSharding(mesh, REPLICATED))(),
                           routing_tree(placements, 1))
    module = KernelScopedModule(build_module(cfg, config.dtype, config.expert_parallel, config.fp8), config.kernels,
                                config.fuse_shared_experts)
    runner = ModelRunner(config, module, params, routing, mesh)
    N, B = config.num_ranks, batch
    rng = np.random.default_rng(0)
    tables = (np.arange(B * nb, dtype=np.int32).reshape(1, B, nb)).repeat(N, 0)
    pos = np.full((N, B), a.ctx - 1, np.int32)
    host = dict(tokens=rng.integers(2, cfg.vocab_size, size=(N, B)).astype(np.int32), positions=pos,
                slots=(tables[:, :, (a.ctx - 1) // bs] * bs + (a.ctx - 1) % bs).astype(np.int32),
                tables=tables, lens=pos + 1)
    samp = (np.zeros((N, B), np.float32), np.ones((N, B), np.float32), np.zeros((N, B), np.int32),
            np.zeros((N, B), np.uint32))  # greedy

    def on_ranks(x):  # each device makes its own rows (a constant of the jitted initialiser)
        return jax.jit(lambda: jnp.asarray(x), out_shardings=NamedSharding(mesh, RANK))()

    args = [on_ranks(host[k]) for k in ("tokens", "positions", "slots", "tables", "lens")]
    return runner, params, routing, args, tuple(on_ranks(s) for s in samp)


def measure(a, dbo: str, batch: int) -> dict:
    import jax
    runner, params, routing, args, samp = build(a, dbo, batch)
    print(f"  built b{batch} dbo {dbo}; compiling", flush=True)
    t = time.perf_counter()
    # The model step alone: sampling is its own small program (moejax/engine/model_runner.py).
    compiled = runner._decode.lower(params, routing, runner.cache, *args).compile()
    compile_s = time.perf_counter() - t
    text = compiled.as_text()
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        with open(os.path.join(a.dump, f"decode_b{batch}_dbo_{dbo}.hlo.txt"), "w") as f:
            f.write(text)
    pairs = overlap_report(text)
    print(f"  compiled in {compile_s:.1f} s; running", flush=True)
    cache = runner.cache
    cache = compiled(params, routing, cache, *args)[0]
    jax.block_until_ready(cache)
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(a.steps):
            cache = compiled(params, routing, cache, *args)[0]
        jax.block_until_ready(cache)
        rounds.append((time.perf_counter() - t) / a.steps)
    return {"batch_per_rank": batch, "dbo": dbo, "step_s": statistics.median(rounds), "rounds_s": rounds,
            "compile_s": compile_s, "all_to_all": count_a2a(text), "overlap": pairs}


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.watchdog:
        faulthandler.dump_traceback_later(a.watchdog, exit=False)
    import jax
    if a.mock_topology:
        jax.config.update("jax_mock_gpu_topology", a.mock_topology)
        # XLA shares GPU autotuning between the processes of a multi-host compile through the
        # distributed key-value store; the 7 mocked processes never answer, so compiling hung (H200,
        # 2026-12-04: the first jitted initialiser was still compiling after 100 s).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false").strip()
    import moejax  # noqa: F401  (sets the XLA flags before the backend starts)
    devs = jax.devices()
    print(f"devices: {len(devs)} ({len(jax.local_devices())} local, {devs[0].platform}); "
          f"{a.preset} with {a.layers} layers, dp{a.ranks}-ep{a.ranks} {a.backend}, ctx {a.ctx}")
    results = []
    for batch in [int(b) for b in a.batch.split(",")]:
        for dbo in a.dbo.split(","):
            r = measure(a, dbo, batch)
            results.append(r)
            moe_pairs = r["overlap"]
            hidden = sum(p["kernels_between"] > 0 for p in moe_pairs)
            print(f"batch {batch:>5}/rank  dbo {dbo:>3}: step {r['step_s'] * 1e3:8.3f} ms "
                  f"(rounds {', '.join(f'{x * 1e3:.3f}' for x in r['rounds_s'])}); all-to-alls: "
                  f"{r['all_to_all']['async']} async, {r['all_to_all']['sync']} sync; "
                  f"{hidden}/{len(moe_pairs)} async ones with kernels between start and done")
            for p in moe_pairs[:8]:
                print(f"    {p['start']}: {p['kernels_between']} kernels between start and done: "
                      f"{', '.join(p['between'][:6])}{' ...' if len(p['between']) > 6 else ''}")
            sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "devices": len(devs), "local_devices": len(jax.local_devices()),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
