"""One decode and one packed-prefill program of the tiny default (lowered as precompile does), their
lower() and compile() times; PROBE_LABELS picks labels by prefix (comma separated). Run from the root."""
import os
import sys
import time

sys.path.insert(0, os.getcwd())
t0 = time.perf_counter()
import moejax  # noqa: E402
if os.environ.get("PROBE_PATCH"):
    exec(open(os.environ["PROBE_PATCH"]).read())
from moejax.server.cli import build_load_kwargs, parse_args  # noqa: E402
from moejax.tiny.default_model import default_model_path  # noqa: E402

print("imports", round(time.perf_counter() - t0, 2), flush=True)
kw = build_load_kwargs(parse_args(sys.argv[1:]))
kw["executable_cache_dir"] = "off"
t1 = time.perf_counter()
m = moejax.load(os.environ.get("PROBE_MODEL") or default_model_path(), progress=False, **kw)
print("load", round(time.perf_counter() - t1, 2), flush=True)
t1 = time.perf_counter()
programs = m.engine.runner.precompile_programs()
steps = [p for p in programs if p.sample_rows]
print("model steps", len(steps), flush=True)
print("precompile_programs", len(programs), round(time.perf_counter() - t1, 2), flush=True)
want = os.environ.get("PROBE_LABELS", "decode B=64,prefill T=1024").split(",")
import jax  # noqa: E402

for w in want:
    p = next(p for p in programs if p.label.startswith(w))
    times = []
    for _ in range(int(os.environ.get("PROBE_REPEAT", "3"))):  # the least of a few (others share the cores)
        jax.clear_caches()
        a = time.perf_counter(); lw = p.lower(); b = time.perf_counter()
        cpu = time.process_time(); c = lw.compile(); d = time.perf_counter()
        times.append((d - b, b - a, time.process_time() - cpu))
    d, b, a = min(times)[0], 0.0, -min(times)[1]
    print(f"{p.label}: compile CPU (all threads, least) {min(t[2] for t in times):.2f} s", flush=True)
    txt = c.as_text() or ""
    print(f"{p.label}: lower {b - a:.2f} s compile {d - b:.2f} s; optimized HLO {len(txt.splitlines())} lines, "
          f"{txt.count(' fusion(')} fusions, {txt.count('custom-call(')} custom-calls, {txt.count(' while(')} whiles",
          flush=True)
    if os.environ.get("PROBE_DUMP"):
        open(f"/tmp/probe_{w.replace(' ', '_')}.hlo", "w").write(txt)
        open(f"/tmp/probe_{w.replace(' ', '_')}.mlir", "w").write(lw.as_text())
