import os, sys, time, concurrent.futures
sys.path.insert(0, os.getcwd())
import moejax, jax
from moejax.tiny.default_model import default_model_path
m = moejax.load(default_model_path(), progress=False, executable_cache_dir="off")
progs = m.engine.runner.precompile_programs()
for n in (int(x) for x in os.environ.get("NS", "1,2").split(",")):
    jax.clear_caches()
    lws = [p.lower() for p in progs]
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda lw: lw.compile(), lws))
    print(f"{n} compile threads: {time.perf_counter() - t:.2f} s for {len(lws)}", flush=True)
