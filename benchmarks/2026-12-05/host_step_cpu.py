"""Issue 18: the engine's whole host work per decode step at high concurrency, with the compiled step
replaced by a stub that returns device arrays at once (no device time), so what is left is the
Python/NumPy loop: scheduling, input building, the read's unpacking, appending, the prefix cache's
bookkeeping, the balancer. The tiny random model: the host's work depends on the batch and the block
tables, not on the model's size.
  python benchmarks/2026-12-05/host_step_cpu.py [concurrency] [context] [--profile]"""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import numpy as np
import bench_decode as bd
from moejax.tiny.presets import preset
from moejax.tiny.random_model import random_model
from moejax.engine.sampling_params import SamplingParams

args = [a for a in sys.argv[1:] if not a.startswith("--")]
C = int(args[0]) if args else 1024
ctx = int(args[1]) if len(args) > 1 else 1900
for mode in ("sync", "async"):
    m = random_model(preset("v3-tiny"), "float32", kernels="xla", max_model_len=ctx + 80, max_num_seqs=C,
                     block_size=64, num_kv_blocks=C * (-(-(ctx + 80) // 64)), async_scheduling=mode == "async")
    eng, r = m.engine, m.engine.runner
    rng = np.random.default_rng(0)
    for _ in range(C):
        eng.add_request(rng.integers(2, 300, size=ctx).tolist(),
                        SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.7, seed=int(rng.integers(1 << 30))))
    bd.fill_without_prefill(eng)
    eng.step()  # the real step once: the shapes the stub returns
    real = r._decode
    fixed = {}
    def stub(params, routing, cache, tokens, positions, *a, mode):
        key = positions.shape
        if key not in fixed:  # the step's outputs once per shape, then returned as they are
            fixed[key] = real(params, routing, cache, tokens, positions, *a, mode=mode)[1:]
        return (cache, *fixed[key])
    r._decode = stub
    for _ in range(3): eng.step()
    n = 30
    t = time.perf_counter()
    if "--profile" in sys.argv and mode == "async":
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for _ in range(n): eng.step()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    else:
        for _ in range(n): eng.step()
    dt = (time.perf_counter() - t) / n
    print(f"{mode}: host work per decode step at c{C} ctx{ctx}: {1e3 * dt:.2f} ms", flush=True)
