"""Prometheus metrics with vLLM's metric names and buckets, exposed through ``prometheus_client``.

Request-level metrics (histograms, token and request counters) are prometheus_client
objects updated by the engine thread's ``on_*`` hooks. Engine-level values (queue sizes,
cache usage, EngineStats counters, EPLB balance) are snapshotted by the engine thread after
each step and exported by a custom collector at scrape time. Each ``Metrics`` has its own
registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import dataclasses
import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moejax import compilation

prometheus_client.disable_created_metrics()  # no *_created samples (vLLM's exposition has none either)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
# KV transfer of a prefilled request (disaggregated serving): vLLM's KV-connector scale, milliseconds to seconds.
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Exports the engine-thread snapshot held by a Metrics at scrape time."""

    def __init__(self, m: Metrics):
        self.m = m

    def collect(self):
        m = self.m
        lab = ["model_name"]
        val = [m.model_name]

        def gauge(name, help_, v):
            g = GaugeMetricFamily(name, help_, labels=lab)
            g.add_metric(val, v)
            return g

        def counter(name, help_, v):  # name without _total: prometheus_client appends it
            c = CounterMetricFamily(name, help_, labels=lab)
            c.add_metric(val, v)
            return c

        with m.lock:
            s = m.engine_stats

            def stat(field, default=0):
                return getattr(s, field, default) if s is not None else default

            yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", m.running)
            yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.waiting)
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage)
            yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", m.num_preemptions)
            yield counter("vllm:prefix_cache_queries",
                          "Prefix cache queries, in terms of number of queried tokens.", stat("prefix_cache_queries"))
            yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                          stat("prefix_cache_hits"))
            yield counter("moejax:prefill_steps", "Engine prefill steps.", stat("prefill_steps"))
            yield counter("moejax:prefill_tokens", "Tokens computed by prefill steps.", stat("prefill_tokens"))
            yield counter("moejax:prefill_time_seconds", "Wall time of prefill steps.", stat("prefill_time", 0.0))
            yield counter("moejax:decode_steps", "Engine decode steps.", stat("decode_steps"))
            yield counter("moejax:decode_tokens", "Tokens produced by decode steps (prefill excluded).",
                          stat("decode_tokens"))
            yield counter("moejax:decode_time_seconds", "Wall time of decode steps alone.", stat("decode_time", 0.0))
            yield gauge("moejax:decode_throughput_tokens_per_second",
                        "decode_tokens_total / decode_time_seconds_total (decode-only throughput).",
                        stat("decode_throughput", 0.0))
            per_pos = stat("spec_accepted_per_pos", ())
            if per_pos:  # speculative decoding on: vLLM's spec_decode counters
                yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stat("spec_num_drafts"))
                yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                              stat("spec_num_draft_tokens"))
                yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                              stat("spec_num_accepted_tokens"))
                pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=["model_name", "position"])
                for i, v in enumerate(per_pos):
                    pos.add_metric([m.model_name, str(i)], v)
                yield pos
            yield counter("moejax:mixed_steps", "Steps that mixed prefill and decode (always 0).", m.steps_mixed)
            built, hits = compilation.COUNTER.snapshot()
            yield counter("moejax:xla_programs_built", "XLA programs built in this process (compiled, or loaded "
                          "from the persistent compilation cache).", built)
            yield counter("moejax:compilation_cache_hits", "XLA programs loaded from the persistent compilation "
                          "cache.", hits)
            yield counter("moejax:compiles_after_startup", "XLA programs built after the server reported ready "
                          "(0 in steady serving: every program is compiled at start-up).",
                          built - m.built_at_ready if m.built_at_ready is not None else 0)
            yield gauge("moejax:startup_compile_seconds", "Seconds the start-up compilation took.",
                        m.startup_seconds)
            yield gauge("moejax:startup_programs", "Programs compiled (or loaded) at start-up.", m.startup_programs)
            yield gauge("moejax:engine_alive", "1 while the engine thread runs, 0 once it died.", m.engine_alive)
            bal = GaugeMetricFamily(
                "moejax:eplb_balancedness",
                "Mean over max (token, expert) pairs per EP rank, measured in the dispatch over the EPLB window "
                "(1 = perfect; imbalance is its inverse); per MoE layer, and overall as the mean over layers.",
                labels=["model_name", "layer"])
            bal.add_metric([m.model_name, "all"], m.eplb_overall)
            for i, b in enumerate(m.eplb_layers):
                bal.add_metric([m.model_name, str(i)], b)
            yield bal
            yield counter("moejax:eplb_rebalances", "Expert placements recomputed and applied.", m.eplb_rebalances)


class Metrics:
    """The server's metrics. Call the ``on_*`` hooks from the engine thread."""

    def __init__(self, model_name: str):
        self.lock = threading.Lock()
        self.built_at_ready: int | None = None  # programs built when the engine became ready
        self.startup_seconds, self.startup_programs = 0.0, 0
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        lab, reg = ["model_name"], self.registry

        def hist(name, help_, buckets):
            return Histogram(name, help_, lab, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        E2E_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lab,
                                         registry=reg).labels(model_name)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=reg)
        for reason in ("stop", "length"):
            self.success.labels(model_name, reason)  # exported at 0 from the start, as before
        self.aborted = Counter("moejax:request_aborted", "Requests aborted (client disconnects).", lab,
                               registry=reg).labels(model_name)
        self.errors = Counter("moejax:request_errors", "Requests failed by an engine fault (their step raised).",
                              lab, registry=reg).labels(model_name)
        # Disaggregated serving (router.py): the prefill -> decode moves of the latent KV cache.
        self.kv_transfer_seconds = hist("moejax:kv_transfer_seconds",
                                        "Histogram of KV-cache transfer time (prefill worker -> decode worker).",
                                        KV_TRANSFER_BUCKETS)
        self.kv_transfer_bytes = Counter("moejax:kv_transfer_bytes", "Bytes of KV cache moved between workers.",
                                         lab, registry=reg).labels(model_name)
        self.kv_transfer_failures = Counter("moejax:kv_transfer_failures",
                                            "KV-cache transfers that failed or missed their deadline (the request "
                                            "was prefilled again).", lab, registry=reg).labels(model_name)
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
        reg.register(_EngineCollector(self))

    # ----- engine-thread hooks -------------------------------------------------
    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc()

    def on_token(self, itl: float, n: int = 1) -> None:
        """A step gave a request n tokens (n > 1: speculative decoding), itl after its previous step."""
        self.itl.observe(itl)
        self.generation_tokens.inc(n)

    def on_finish(self, reason: str, e2e: float, ttft: float | None, num_output: int) -> None:
        if reason == "abort":
            self.aborted.inc()
            return
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e)
        if ttft is not None and num_output > 1:
            self.tpot.observe((e2e - ttft) / (num_output - 1))

    def on_error(self) -> None:
        self.errors.inc()

    def on_kv_transfer(self, seconds: float, nbytes: int) -> None:
        self.kv_transfer_seconds.observe(seconds)
        self.kv_transfer_bytes.inc(nbytes)

    def on_kv_transfer_failed(self) -> None:
        self.kv_transfer_failures.inc()

    def on_ready(self, startup: dict | None) -> None:
        """The engine finished its start-up compilation: later builds count as compiles after start-up."""
        with self.lock:
            self.built_at_ready = compilation.COUNTER.snapshot()[0]
            self.startup_seconds = (startup or {}).get("seconds", 0.0)
            self.startup_programs = (startup or {}).get("programs", 0)

    def compiles_after_startup(self) -> int:
        with self.lock:
            return compilation.COUNTER.snapshot()[0] - self.built_at_ready if self.built_at_ready is not None else 0

    def snapshot(self, engine, mixed_steps: int) -> None:
        with self.lock:
            self.running = len(engine.scheduler.running) + len(engine.scheduler.prefilling)
            self.waiting = len(engine.scheduler.waiting)
            self.kv_usage = engine.blocks.usage
            self.num_preemptions = engine.scheduler.num_preemptions
            self.engine_stats = dataclasses.replace(engine.stats)
            self.steps_mixed = mixed_steps
            bal = getattr(engine, "balancer", None)
            if bal is not None:
                bal.read_counts(wait=False)  # the steps already done: no per-step device sync
            if bal is not None and bal.dispatched:
                self.eplb_layers, self.eplb_overall = bal.balancedness(wait=False)
                self.eplb_rebalances = bal.num_rebalances

    # ----- exposition ------------------------------------------------------------
    def render(self) -> str:
        return generate_latest(self.registry).decode()


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
