"""Per-family trace and XLA compile seconds of a small tiny-default config, and the decode step time, under $XLA_FLAGS."""
import collections, os, sys, time, json
sys.path.insert(0, "/work/main")
import moejax
from moejax.engine.sampling_params import SamplingParams
from moejax.tiny.default_model import default_model_path
m = moejax.load(default_model_path(), max_num_seqs=8, max_model_len=256, max_prefill_tokens=256, compilation_cache_dir="off", progress=False)
r = m.engine.runner
t = time.perf_counter(); ps = r.precompile_programs(); enum = time.perf_counter() - t
trace, comp = collections.Counter(), collections.Counter()
for p in ps:
    fam = p.label.split()[0]
    t = time.perf_counter(); low = p.lower(); t1 = time.perf_counter(); c = low.compile(); t2 = time.perf_counter()
    trace[fam] += t1 - t; comp[fam] += t2 - t1
    if isinstance(p.fn, moejax.executable_cache.PrecompiledFunction):
        p.fn.install(moejax.executable_cache.signature(p.args), c)
r.precompiled = True
eng = m.engine
rng = __import__("numpy").random.default_rng(0)
seqs = [eng.add_request(rng.integers(5, 300, 40).tolist(), SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)) for _ in range(8)]
times = []
while eng.has_unfinished():
    t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
times = sorted(times[5:])
print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""), "programs": len(ps), "enumerate_s": round(enum, 2),
                  "lower_s": {k: round(v, 2) for k, v in trace.items()}, "compile_s": {k: round(v, 2) for k, v in comp.items()},
                  "compile_total": round(sum(comp.values()), 2), "step_ms_median": round(1000 * times[len(times) // 2], 2)}))
