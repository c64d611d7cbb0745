"""Prometheus metrics in the text exposition format, with vLLM's metric names.

No prometheus_client dependency: counters, gauges and histograms are a few lines
each. All updates come from the engine thread; /metrics reads under a lock.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return f"{float(v):.1f}"
    return repr(float(v))


def _labels(d: dict) -> str:
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in d.items()) + "}"


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class Metrics:
    """The server's metrics. Call the ``on_*`` hooks from the engine thread."""

    def __init__(self, model_name: str):
        self.lock = threading.Lock()
        self.labels = {"model_name": model_name}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0}
        self.aborted = 0
        self.errors = 0
        # gauges / engine counters, snapshotted by the engine thread after each step
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.num_preemptions = 0
        self.engine_stats = None  # a copy of EngineStats
        self.steps_mixed = 0
        self.engine_alive = 1
        self.eplb_layers: list[float] = []  # balancedness per MoE layer (measured dispatch, sliding window)
        self.eplb_overall = 1.0
        self.eplb_rebalances = 0

    # ----- engine-thread hooks -------------------------------------------------
    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        with self.lock:
            self.ttft.observe(ttft)
            self.prompt_tokens += num_prompt_tokens
            self.generation_tokens += 1

    def on_token(self, itl: float) -> None:
        with self.lock:
            self.itl.observe(itl)
            self.generation_tokens += 1

    def on_finish(self, reason: str, e2e: float, ttft: float | None, num_output: int) -> None:
        with self.lock:
            if reason == "abort":
                self.aborted += 1
                return
            self.success[reason] = self.success.get(reason, 0) + 1
            self.e2e.observe(e2e)
            if ttft is not None and num_output > 1:
                self.tpot.observe((e2e - ttft) / (num_output - 1))

    def snapshot(self, engine, mixed_steps: int) -> None:
        with self.lock:
            self.running = len(engine.scheduler.running)
            self.waiting = len(engine.scheduler.waiting)
            self.kv_usage = engine.blocks.usage
            self.num_preemptions = engine.scheduler.num_preemptions
            self.engine_stats = dataclasses.replace(engine.stats)
            self.steps_mixed = mixed_steps
            bal = engine.balancer
            if bal.dispatched:
                self.eplb_layers, self.eplb_overall = bal.balancedness()
                self.eplb_rebalances = bal.num_rebalances

    # ----- exposition ------------------------------------------------------------
    def render(self) -> str:
        L = self.labels
        out: list[str] = []

        def metric(name, kind, help_, samples):
            base = name[:-6] if kind == "counter" and name.endswith("_total") else name
            out.append(f"# HELP {base} {help_}")
            out.append(f"# TYPE {base} {kind}")
            for labels, v in samples:
                out.append(f"{name}{_labels(labels)} {_fmt(v)}")

        def hist(name, help_, h: Histogram):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            acc = 0
            for le, c in zip(list(h.buckets) + [math.inf], h.counts):
                acc += c
                out.append(f"{name}_bucket{_labels({**L, 'le': _fmt(le)})} {_fmt(acc)}")
            out.append(f"{name}_sum{_labels(L)} {_fmt(h.sum)}")
            out.append(f"{name}_count{_labels(L)} {_fmt(h.count)}")

        with self.lock:
            s = self.engine_stats
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [(L, self.running)])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [(L, self.waiting)])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   [(L, self.kv_usage)])
            metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.",
                   [(L, self.num_preemptions)])
            metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                   [(L, self.prompt_tokens)])
            metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                   [(L, self.generation_tokens)])
            metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                   [({**L, "finished_reason": r}, n) for r, n in sorted(self.success.items())])
            hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft)
            hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl)
            hist("vllm:request_time_per_output_token_seconds",
                 "Histogram of time_per_output_token_seconds per request.", self.tpot)
            hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e)
            metric("moejax:request_aborted_total", "counter", "Requests aborted (client disconnects).",
                   [(L, self.aborted)])
            metric("moejax:prefill_steps_total", "counter", "Engine prefill steps.",
                   [(L, s.prefill_steps if s else 0)])
            metric("moejax:prefill_tokens_total", "counter", "Tokens computed by prefill steps.",
                   [(L, s.prefill_tokens if s else 0)])
            metric("moejax:prefill_time_seconds_total", "counter", "Wall time of prefill steps.",
                   [(L, s.prefill_time if s else 0.0)])
            metric("moejax:decode_steps_total", "counter", "Engine decode steps.",
                   [(L, s.decode_steps if s else 0)])
            metric("moejax:decode_tokens_total", "counter", "Tokens produced by decode steps (prefill excluded).",
                   [(L, s.decode_tokens if s else 0)])
            metric("moejax:decode_time_seconds_total", "counter", "Wall time of decode steps alone.",
                   [(L, s.decode_time if s else 0.0)])
            metric("moejax:decode_throughput_tokens_per_second", "gauge",
                   "decode_tokens_total / decode_time_seconds_total (decode-only throughput).",
                   [(L, s.decode_throughput if s else 0.0)])
            metric("moejax:mixed_steps_total", "counter", "Steps that mixed prefill and decode (always 0).",
                   [(L, self.steps_mixed)])
            metric("moejax:engine_alive", "gauge", "1 while the engine thread runs, 0 once it died.",
                   [(L, self.engine_alive)])
            metric("moejax:eplb_balancedness", "gauge",
                   "Mean over max (token, expert) pairs per EP rank, measured in the dispatch over the EPLB window "
                   "(1 = perfect; imbalance is its inverse); per MoE layer, and overall as the mean over layers.",
                   [({**L, "layer": "all"}, self.eplb_overall)]
                   + [({**L, "layer": str(i)}, b) for i, b in enumerate(self.eplb_layers)])
            metric("moejax:eplb_rebalances_total", "counter", "Expert placements recomputed and applied.",
                   [(L, self.eplb_rebalances)])
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Parses exposition text into {"name{labels}": value}, plus {"name": sum over its label sets}
    for every sample that is not a histogram bucket."""
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            v = float(val)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if not name.endswith("_bucket"):
            sums[name] = sums.get(name, 0.0) + v
    out.update(sums)
    return out
