import os, sys, time
sys.path.insert(0, os.getcwd())
import moejax, jax, numpy as np
from moejax.tiny.default_model import default_model_path
m = moejax.load(default_model_path(), progress=False, executable_cache_dir="off")
r = m.engine.runner
progs = r.precompile_programs()
for lb in os.environ.get("LABELS", "decode B=1 W=32|decode B=256 W=32|prefill T=1024").split("|"):
    p = next(p for p in progs if p.label.startswith(lb))
    c = p.lower().compile()
    args = [a for a in p.args]
    # concrete inputs: zeros for abstract ones
    conc = [np.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a for a in args]
    params, routing, cache = conc[0], conc[1], conc[2]
    rest = conc[3:]
    cache = r.cache
    out = c(params, routing, cache, *rest); jax.block_until_ready(out); cache = out[0]
    ts = []
    for _ in range(int(os.environ.get("REPS", "30"))):
        t = time.perf_counter(); out = c(params, routing, cache, *rest); jax.block_until_ready(out); ts.append(time.perf_counter() - t); cache = out[0]
    r.cache = cache
    print(f"{p.label}: run {np.median(ts)*1000:.2f} ms (median), min {min(ts)*1000:.2f}", flush=True)
