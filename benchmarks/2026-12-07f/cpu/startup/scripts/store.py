import os, sys, time, pickle
sys.path.insert(0, os.getcwd())
import moejax
from moejax.tiny.default_model import default_model_path
from jax.experimental import serialize_executable
from moejax import executable_check
m = moejax.load(default_model_path(), progress=False, executable_cache_dir="off")
progs = m.engine.runner.precompile_programs()
tot = [0, 0, 0, 0]
for p in progs[:26]:
    c = p.lower().compile()
    a = time.perf_counter(); s = serialize_executable.serialize(c); b = time.perf_counter()
    pr = executable_check.cpu_problem(s[0]); cc = time.perf_counter()
    d = pickle.dumps(s); e = time.perf_counter()
    tot[0] += b - a; tot[1] += cc - b; tot[2] += e - cc; tot[3] += len(d)
print("serialize %.2f check %.2f pickle %.2f bytes %d (26 steps)" % tuple(tot))
