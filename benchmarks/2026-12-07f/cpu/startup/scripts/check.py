"""Tokens and logprobs of the tiny default (a fixed mixed batch), and compile times of three programs."""
import os, sys, time, hashlib
sys.path.insert(0, os.getcwd())
import moejax, jax, numpy as np
from moejax.tiny.default_model import default_model_path
from moejax.engine.sampling_params import SamplingParams
kw = dict(progress=False, executable_cache_dir="off", **({"dtype": os.environ["DT"]} if os.environ.get("DT") else {}))
m = moejax.load(default_model_path(), **kw)
r = m.engine.runner
progs = r.precompile_programs()
print("programs", len(progs))
for lb in os.environ.get("LABELS", "decode B=64 W=32|prefill T=1024|prefill_paged B=1 S=64").split("|"):
    p = next(p for p in progs if p.label.startswith(lb))
    best = None
    for _ in range(int(os.environ.get("REP", "3"))):
        jax.clear_caches()
        c0 = time.process_time(); t = time.perf_counter(); lw = p.lower(); t1 = time.perf_counter(); c1 = time.process_time(); c = lw.compile(); t2 = time.perf_counter(); c2 = time.process_time()
        cur = (t1 - t, t2 - t1, c1 - c0, c2 - c1)
        best = cur if best is None else tuple(min(a, b) for a, b in zip(best, cur))
    txt = c.as_text()
    print(f"{p.label}: lower {best[0]:.3f} compile {best[1]:.3f} cpu lower {best[2]:.3f} compile {best[3]:.3f} hlo {len(txt.splitlines())} whiles {txt.count(' while(')}", flush=True)
if os.environ.get("GEN", "1") == "1":
    rng = np.random.default_rng(0)
    eng = m.engine
    lens = (3, 17, 70, 300, 5, 1100, 40, 2)
    sps = [SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True),
           SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, top_p=0.9, logprobs=True, ignore_eos=True),
           SamplingParams(max_new_tokens=12, temperature=0.7, seed=5, logprobs=True, ignore_eos=True),
           SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=1.2, logprobs=True, ignore_eos=True)]
    seqs = [eng.add_request(rng.integers(2, 300, size=n).tolist(), sps[i % 4]) for i, n in enumerate(lens)]
    t = time.perf_counter()
    eng.run_to_completion(seqs)
    print("generate", round(time.perf_counter() - t, 2))
    h = hashlib.sha256()
    for s in seqs:
        h.update(repr((s.output_ids, s.logprobs, s.top_logprobs)).encode())
    print(seqs[0].output_ids, seqs[0].logprobs[:3])
    print("HASH", h.hexdigest())
    # decode step time at 64 sequences (steady state)
    seqs = [eng.add_request(rng.integers(2, 300, size=20).tolist(), SamplingParams(max_new_tokens=40, ignore_eos=True)) for _ in range(64)]
    t = time.perf_counter(); eng.run_to_completion(seqs); print("64x40 tokens", round(time.perf_counter() - t, 2))
