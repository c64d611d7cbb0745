import time, sys, os
sys.path.insert(0, "/work/main")
import moejax
from moejax.tiny.default_model import default_model_path
m = moejax.load(default_model_path(), max_num_seqs=8, max_model_len=256, max_prefill_tokens=256, progress=False)
r = m.engine.runner
ps = [p for p in r.precompile_programs() if p.label.split()[0] in ("decode", "prefill", "prefill_paged")][:int(sys.argv[1])]
lows = [p.lower() for p in ps]
t = time.perf_counter(); pt = time.process_time()
for lw in lows: lw.compile()
c = time.perf_counter() - t; pc = time.process_time() - pt
# step time of the last decode program
print(f"FLAGS={os.environ.get('XLA_FLAGS','')!r} n={len(ps)} compile={c:.2f}s cpu={pc:.2f}s", flush=True)
