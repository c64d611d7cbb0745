import os, sys, time
sys.path.insert(0, os.getcwd())
t0 = time.perf_counter()
import moejax
from moejax.tiny.default_model import default_model_path
m = moejax.load(default_model_path(), progress=False, executable_cache_dir="off")
t1 = time.perf_counter()
progs = m.engine.runner.precompile_programs()
t2 = time.perf_counter()
lws = [p.lower() for p in progs]
t3 = time.perf_counter()
fam = {}
for p, lw in zip(progs, lws):
    a = time.perf_counter(); lw.compile(); fam[p.label.split()[0]] = fam.get(p.label.split()[0], 0) + time.perf_counter() - a
t4 = time.perf_counter()
print(f"import+load {t1-t0:.2f} programs {t2-t1:.2f} lower {t3-t2:.2f} compile {t4-t3:.2f}", {k: round(v, 2) for k, v in fam.items()})
