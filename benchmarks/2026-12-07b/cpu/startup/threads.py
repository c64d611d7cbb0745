import os, sys, time
sys.path.insert(0, "/work/main")
import moejax
from moejax.tiny.default_model import default_model_path
m = moejax.load(default_model_path(), max_num_seqs=8, max_model_len=256, max_prefill_tokens=256, compilation_cache_dir="off", progress=False)
m.engine
t = time.perf_counter(); out = m.engine.precompile(progress=False)
print("threads", os.environ["MOEJAX_COMPILE_THREADS"], out["programs"], "precompile s", round(time.perf_counter() - t, 1))
