"""Issue 18: where the decode loop's host time goes, synchronous vs async scheduling (V2-Lite, few layers).
Each engine phase is wrapped with a timer; plus a probe: how long a jitted call with numpy arguments
takes to return while the device is busy (if H2D copies of numpy inputs wait for the running step,
dispatch is synchronous and async scheduling cannot overlap)."""
import collections, functools, json, sys, time, os
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import jax, jax.numpy as jnp, numpy as np
import bench_decode as bd
from moejax.tiny.presets import preset, with_layers
from moejax.tiny.random_model import random_model
from moejax.engine.sampling_params import SamplingParams

out = {}
# --- probe: dispatch latency of a jit call while the device is busy
N = 8192 if jax.default_backend() == "gpu" else 256
big = jnp.ones((N, N), jnp.bfloat16)
busy = jax.jit(lambda x: functools.reduce(lambda a, _: (a @ x).astype(jnp.bfloat16), range(20), x))
small = jax.jit(lambda a, b, c: a.sum() + b.sum() + c.sum())
args_np = [np.ones((256,), np.int32), np.ones((256, 128), np.int32), np.ones((256,), np.float32)]
args_dev = jax.device_put(args_np)
busy(big).block_until_ready(); small(*args_np).block_until_ready()
for kind, args in (("numpy", args_np), ("device", args_dev), ("numpy", args_np), ("device", args_dev)):
    t0 = time.perf_counter(); y = busy(big); t1 = time.perf_counter()
    r = small(*args); t2 = time.perf_counter()
    y.block_until_ready(); t3 = time.perf_counter(); r.block_until_ready()
    print(f"probe {kind:>6} args: busy dispatch {1e3*(t1-t0):.3f} ms, small call returns after {1e3*(t2-t1):.3f} ms, busy done at {1e3*(t3-t0):.3f} ms", flush=True)
    out.setdefault("probe", []).append({"args": kind, "call_return_ms": 1e3*(t2-t1), "busy_ms": 1e3*(t3-t0)})

# --- engine phases
L, C = int(sys.argv[1]), int(sys.argv[2])
hf = with_layers(preset("deepseek-v2-lite"), L)
for mode in ("sync", "async", "sync", "async"):
    m = random_model(hf, "bfloat16", kernels="auto", max_model_len=2048 + 64, max_num_seqs=C,
                     num_kv_blocks=C * 132, async_scheduling=mode == "async")
    eng = m.engine; r = eng.runner
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
    seqs = [eng.add_request(rng.integers(2, 1000, size=2000).tolist(), SamplingParams(max_new_tokens=40, ignore_eos=True)) for _ in range(C)]
    bd.fill_without_prefill(eng)
    for _ in range(4): eng.step()
    if mode == "sync" and "hlo_ops" not in out:  # host-syncing control flow left in the compiled step?
        import re
        real, args, kw = bd.capture_decode_args(eng)
        txt = real.lower(*args, **kw).compile().as_text()
        out["hlo_ops"] = {op: len(re.findall(rf"\b{op}\(", txt)) for op in ("conditional", "while", "sort", "custom-call")}
        print(f"   compiled decode step: {out['hlo_ops']}", flush=True)
    wrap(r, "_decode", "jit call (dispatch)"); wrap(r, "_feed", "feed call"); wrap(r, "_gather", "read (D2H wait + unpack)")
    wrap(r, "_sampling_arrays", "sampling arrays"); wrap(eng.scheduler, "schedule", "schedule"); wrap(eng, "_append", "append")
    wrap(eng.balancer, "record", "balancer.record"); wrap(eng.blocks, "cache_computed", "cache_computed")
    wrap(r, "dispatch_decode", "dispatch_decode total")
    n = 16; t = time.perf_counter()
    for _ in range(n): eng.step()
    total = (time.perf_counter() - t) / n
    ph = {k: 1e3 * v / n for k, v in acc.items()}
    print(f"{mode}: engine step {1e3*total:.3f} ms; per step: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])), flush=True)
    out.setdefault("phases", []).append({"mode": mode, "step_ms": 1e3 * total, "phases_ms": ph})
    dev = bd.device_step_time(eng, 8)
    print(f"   device step alone {1e3*dev:.3f} ms", flush=True)
    out["phases"][-1]["device_ms"] = 1e3 * dev
    del m, eng, r, seqs
    import gc; gc.collect()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_phases.json"), "w"), indent=1)
