"""Issue 18: the decode loop's host phases at c1024 on the CPU (tiny random model: the host's work per
step depends on the batch and the block tables, not on the model's size). Each phase wrapped with a
timer; the device step here is the CPU's, so only the host rows mean anything.
  python benchmarks/2026-12-05/host_phases_cpu.py [concurrency] [context]"""
import collections, functools, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import numpy as np
import bench_decode as bd
from moejax.tiny.presets import preset
from moejax.tiny.random_model import random_model
from moejax.engine.sampling_params import SamplingParams

C = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 500
for mode in ("sync", "async"):
    m = random_model(preset("v3-tiny"), "float32", kernels="xla", max_model_len=ctx + 64, max_num_seqs=C,
                     block_size=16, num_kv_blocks=C * (-(-(ctx + 64) // 16)), async_scheduling=mode == "async")
    eng, r = m.engine, m.engine.runner
    acc = collections.defaultdict(float)
    def wrap(obj, name, label):
        f = getattr(obj, name)
        @functools.wraps(f)
        def g(*a, **k):
            t = time.perf_counter()
            try: return f(*a, **k)
            finally: acc[label] += time.perf_counter() - t
        setattr(obj, name, g)
    rng = np.random.default_rng(0)
    for _ in range(C):
        eng.add_request(rng.integers(2, 300, size=ctx).tolist(), SamplingParams(max_new_tokens=40, ignore_eos=True))
    bd.fill_without_prefill(eng)
    for _ in range(4): eng.step()
    wrap(r, "_decode", "jit call"); wrap(r, "_feed", "feed call"); wrap(r, "_gather", "read (wait + unpack)")
    wrap(r, "_sampling_arrays", "sampling arrays"); wrap(eng.scheduler, "schedule", "schedule"); wrap(eng, "_append", "append")
    wrap(eng.balancer, "record", "balancer.record"); wrap(eng.blocks, "cache_computed", "cache_computed")
    wrap(r, "dispatch_decode", "dispatch_decode total")
    n = 10; t = time.perf_counter()
    for _ in range(n): eng.step()
    total = (time.perf_counter() - t) / n
    ph = {k: 1e3 * v / n for k, v in acc.items()}
    ph["inputs (dispatch_decode - calls)"] = ph["dispatch_decode total"] - ph["jit call"] - ph.get("feed call", 0) - ph["sampling arrays"]
    print(f"{mode} c{C} ctx{ctx}: engine step {1e3*total:.2f} ms; " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])), flush=True)
