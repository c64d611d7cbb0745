"""scripts/bench_startup.py's split of a start-up from the server's own log lines (moejax/engine/precompile.py's
and executable_set.py's formats): loading up to the first program, XLA compiling, executable loading, and the
rest of the precompile span as tracing and lowering."""

import datetime
import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location(
    "bench_startup", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_startup.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _line(t: datetime.datetime, text: str) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d} moejax.precompile: {text}"


def test_shares_from_the_program_lines():
    t0 = datetime.datetime(2026, 12, 7, 6, 0, 0)
    s = datetime.timedelta(seconds=1)
    lines = ["Loading weights ...",
             _line(t0 + 5 * s, "compiled decode B=1 W=16 in 1.00 s (1/3)"),  # began at 4 s
             _line(t0 + 8 * s, "compiled prefill T=16 B=16 in 2.00 s (2/3)"),  # 1 s of tracing before it
             "\rCompiling programs: 67%" + _line(t0 + 8.5 * s, "loaded sample rows=1 in 0.25 s (3/3)"),  # bar's line
             _line(t0 + 9 * s, "executable cache /x: 1 loaded, 2 built (2 not there)")]
    out = bench.parse_log(lines, t0.timestamp())
    assert out["programs_compiled"] == 2 and out["programs_loaded"] == 1
    assert out["load_s"] == 4.0 and out["xla_compile_s"] == 3.0 and out["executable_load_s"] == 0.25
    assert out["trace_lower_s"] == 4.5 - 3.0 - 0.25 and out["build_busy_s"] == 3.25
    assert bench.CACHE_LINE.search(lines[-1]).group(1).startswith("executable cache /x: 1 loaded")


def test_overlapping_builds_count_once_in_the_busy_span():
    """Two compile workers: builds [4, 6] and [5, 8] s, then a gap, then [9, 10]: 6 s of building, 5 busy."""
    t0 = datetime.datetime(2026, 12, 8, 6, 0, 0)
    s = datetime.timedelta(seconds=1)
    lines = [_line(t0 + 6 * s, "compiled decode B=1 W=16 in 2.00 s (1/3)"),
             _line(t0 + 8 * s, "compiled prefill T=16 B=16 in 3.00 s (2/3)"),
             _line(t0 + 10 * s, "compiled sample rows=1 in 1.00 s (3/3)")]
    out = bench.parse_log(lines, t0.timestamp())
    assert out["load_s"] == 4.0 and out["xla_compile_s"] == 6.0 and out["build_busy_s"] == 5.0
    assert out["trace_lower_s"] == 1.0
