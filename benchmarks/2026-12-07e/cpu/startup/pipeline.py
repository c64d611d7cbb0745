"""The tiny default's whole precompiled set built in one process, timed: PIPE=inline (lower then compile,
one program after another: precompile's CPU path before 2026-12-07e) or PIPE=pool1 (lowered in this thread,
compiled in one worker thread, so Python's tracing overlaps XLA). PROBE_PATCH: a file exec'd first."""
import concurrent.futures
import os
import sys
import time

sys.path.insert(0, os.getcwd())
t0, c0 = time.perf_counter(), time.process_time()
import moejax  # noqa: E402
if os.environ.get("PROBE_PATCH"):
    exec(open(os.environ["PROBE_PATCH"]).read())
from moejax.server.cli import build_load_kwargs, parse_args  # noqa: E402
from moejax.tiny.default_model import default_model_path  # noqa: E402

kw = build_load_kwargs(parse_args(sys.argv[1:]))
kw["executable_cache_dir"] = "off"
m = moejax.load(default_model_path(), progress=False, **kw)
t1 = time.perf_counter()
programs = m.engine.runner.precompile_programs()
t2 = time.perf_counter()
comp = [0.0]


def compile_one(lw):
    a = time.perf_counter()
    lw.compile()
    comp[0] += time.perf_counter() - a


if os.environ.get("PIPE", "inline") == "inline":
    for p in programs:
        compile_one(p.lower())
else:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for f in [pool.submit(compile_one, p.lower()) for p in programs]:
            f.result()
t3 = time.perf_counter()
print(f"PIPE={os.environ.get('PIPE', 'inline')} patch={os.environ.get('PROBE_PATCH', '')}: imports+load "
      f"{t1 - t0:.1f} s, precompile_programs {t2 - t1:.1f} s, lower+compile {t3 - t2:.1f} s "
      f"(compile calls {comp[0]:.1f} s), total {t3 - t0:.1f} s, CPU {time.process_time() - c0:.1f} s "
      f"(all threads), load {os.getloadavg()[0]:.2f}", flush=True)
