import time, sys
t0=time.perf_counter()
sys.path.insert(0, "/work/main")
import moejax
from moejax.server.cli import build_parser, build_load_kwargs
from moejax.tiny.default_model import default_model_path
t1=time.perf_counter(); print("imports", round(t1-t0,2), flush=True)
a = build_parser().parse_args(sys.argv[1:])
kw = build_load_kwargs(a) if callable(build_load_kwargs) else {}
print({k: v for k, v in kw.items() if k in ("max_num_seqs","max_model_len","max_prefill_tokens")}, flush=True)
m = moejax.load(default_model_path(), **kw)
t2=time.perf_counter(); print("load", round(t2-t1,2), flush=True)
r = m.engine.runner
ps = r.precompile_programs()
t3=time.perf_counter(); print("programs", len(ps), round(t3-t2,2), flush=True)
import collections
tl=collections.defaultdict(float); tc=collections.defaultdict(float)
for p in ps:
    f=p.label.split()[0]
    a_=time.perf_counter(); lw=p.lower(); b=time.perf_counter(); lw.compile(); c=time.perf_counter()
    tl[f]+=b-a_; tc[f]+=c-b
t4=time.perf_counter(); print("lower+compile", round(t4-t3,2))
for f in tl: print(f"{f:15s} lower {tl[f]:6.2f} compile {tc[f]:6.2f}")
