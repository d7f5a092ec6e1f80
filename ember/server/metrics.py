"""Prometheus metrics, through prometheus-client, in a registry of this app's own.

Latencies are measured where the client sees them: from the request's arrival at the handler to
each piece of output handed to the response. Engine state (running, waiting, KV usage,
preemptions) is read from the engine's published stats at scrape time. The `vllm:` names are
the ones Kubernetes inference routers (the Gateway API Inference Extension's endpoint picker)
read by default, so such routers work with ember unmodified.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember.engine.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class EngineCollector(Collector):
    """Gauges and counters read from AsyncEngine.stats when /metrics is scraped."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        core = self.engine.core
        for prefix in ("ember_", "vllm:"):
            yield self._gauge(f"{prefix}num_requests_running", "Requests running in the engine",
                              stats.num_running)
            yield self._gauge(f"{prefix}num_requests_waiting", "Requests waiting to run",
                              stats.num_waiting)
            yield self._gauge(f"{prefix}kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full)",
                              stats.kv_cache_usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc for "
                          "older routers", stats.kv_cache_usage)
        yield self._counter("ember_num_preemptions", "Requests preempted (KV recomputed) "
                            "because blocks or seats ran out", stats.num_preemptions)
        for prefix in ("ember_", "vllm:"):
            yield self._counter(f"{prefix}prefix_cache_queries", "Prompt tokens looked up in "
                                "the prefix cache", stats.prefix_cache_queries)
            yield self._counter(f"{prefix}prefix_cache_hits", "Prompt tokens found in the "
                                "prefix cache", stats.prefix_cache_hits)
        yield self._counter("ember_prefix_cache_evictions", "Cached blocks given up to make "
                            "room", stats.prefix_cache_evictions)
        yield self._gauge("ember_prefix_cache_blocks", "Blocks holding a cached prefix",
                          stats.num_cached_blocks)
        if core is not None:
            info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration",
                                     labels=["block_size", "num_gpu_blocks", "model_name"])
            info.add_metric([str(core.cache_info.block_size), str(core.cache_info.num_blocks),
                             self.model_name], 1.0)
            yield info

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric([self.model_name], value)
        return counter

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("ember_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ember_inter_token_latency_seconds", "Gap between consecutive "
                             "pieces of streamed output", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("ember_time_per_output_token_seconds", "Per request: (E2E - TTFT) "
                              "/ (output tokens - 1)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ember_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("ember_request_queue_time_seconds", "Time waiting before the "
                               "first step", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram("ember_request_prompt_tokens", "Prompt length per request",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram("ember_request_generation_tokens", "Generated tokens per "
                                 "request", buckets=TOKEN_BUCKETS, registry=r)
        self.finished = Counter("ember_request_success", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.aborted = Counter("ember_request_aborts", "Requests aborted, by reason",
                               ["reason"], registry=r)
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("ember_generation_tokens", "Tokens generated",
                                         registry=r)
        r.register(EngineCollector(engine, model_name))

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Timings of one HTTP request, reported to the metrics once it ends."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.num_output_tokens = 0
        self.done = False

    def on_output(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_output_tokens += num_tokens
        self.metrics.generation_tokens.inc(num_tokens)  # as it streams, so rate() is live

    def on_finish(self, finish_reasons: list[str], num_prompt_tokens: int,
                  queue_times: list[float]) -> None:
        m, self.done = self.metrics, True
        e2e = time.monotonic() - self.start
        m.e2e.observe(e2e)
        if self.first is not None and self.num_output_tokens > 1:
            m.tpot.observe((e2e - (self.first - self.start)) / (self.num_output_tokens - 1))
        for q in queue_times:
            m.queue.observe(q)
        for reason in finish_reasons:
            m.finished.labels(reason).inc()
        m.prompt_len.observe(num_prompt_tokens)
        m.gen_len.observe(self.num_output_tokens)
        m.prompt_tokens.inc(num_prompt_tokens)

    def on_abort(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.metrics.aborted.labels(reason).inc()
