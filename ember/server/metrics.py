"""Prometheus metrics, through prometheus-client, in a registry of this app's own.

Latencies are measured where the client sees them: from the request's arrival at the server
(before its body is read) to each piece of output handed to the response. Engine state
(running, waiting, KV usage, preemptions) is read from the engine's published stats at scrape
time. The `vllm:` names are the ones Kubernetes inference routers (the Gateway API Inference
Extension's endpoint picker) read by default, so such routers work with ember unmodified.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember.engine.async_engine import AsyncEngine
from ember.kv_transfer.params import FALLBACK_REASONS

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
        yield from self._spec_metrics(stats)
        if stats.kv_transfer is not None:
            yield from self._transfer_metrics(stats.kv_transfer)
        if stats.pipeline_bubble is not None:
            yield self._gauge("ember_pipeline_bubble_ratio", "Share of a pipeline stage's time "
                              "idle by the schedule: (P-1)/(M+P-1) per forward of M "
                              "micro-batches, over every forward so far",
                              stats.pipeline_bubble)
        if core is not None:
            yield self._load_phases(core.load_phases.seconds)
            info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration",
                                     labels=["block_size", "num_gpu_blocks", "model_name"])
            info.add_metric([str(core.cache_info.block_size), str(core.cache_info.num_blocks),
                             self.model_name], 1.0)
            yield info

    def _spec_metrics(self, stats) -> Iterator[Metric]:
        """Speculative decoding: vLLM's counters, and the acceptance rate and mean accepted
        length (accepted drafts + the target's own token, per verification) they give."""
        yield self._counter("vllm:spec_decode_num_drafts", "Verifications of a request's "
                            "drafted tokens", stats.spec_num_drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified",
                            stats.spec_num_draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the "
                            "target model accepted", stats.spec_num_accepted_tokens)
        drafted, drafts = stats.spec_num_draft_tokens, stats.spec_num_drafts
        yield self._gauge("ember_spec_decode_acceptance_rate", "Accepted / drafted tokens "
                          "since start (0 before any draft)",
                          stats.spec_num_accepted_tokens / drafted if drafted else 0.0)
        yield self._gauge("ember_spec_decode_mean_accepted_length", "Tokens a verification "
                          "emits on average: accepted drafts + 1 (0 before any draft)",
                          1 + stats.spec_num_accepted_tokens / drafts if drafts else 0.0)

    def _transfer_metrics(self, t) -> Iterator[Metric]:
        """Disaggregated serving (ember/kv_transfer/): a prefill replica's pins, a decode
        replica's pulls; GB/s is bytes / seconds over any window."""
        yield self._counter("ember_kv_transfer_exports", "Prompts whose blocks were pinned "
                            "for a decode replica", t.num_exports)
        yield self._gauge("ember_kv_transfer_pinned_blocks", "Blocks pinned for decode "
                          "replicas now", t.pinned_blocks)
        yield self._labelled("ember_kv_transfer_pins_released", "Pins that ended, by how: "
                             "released (pulled, or aborted), expired, stopped (a stop string "
                             "ended the request)", "reason",
                             {r: 0 for r in ("released", "expired", "stopped")} | t.releases)
        yield self._counter("ember_kv_transfer_bytes_served", "Block bytes streamed to "
                            "decode replicas over HTTP", t.bytes_served)
        yield self._counter("ember_kv_transfer_loads", "Prompts whose KV was pulled from a "
                            "prefill replica", t.num_loads)
        yield self._labelled("ember_kv_transfer_bytes", "Block bytes pulled, by transport",
                             "transport", {"shm": 0, "http": 0} | t.bytes_loaded)
        yield self._counter("ember_kv_transfer_seconds", "Seconds pulls took, from claim to "
                            "release", t.seconds_loading)
        yield self._counter("ember_kv_transfer_blocks_loaded", "Blocks pulled",
                            t.blocks_loaded)
        yield self._counter("ember_kv_transfer_blocks_skipped", "Blocks not pulled: this "
                            "replica's prefix cache held them", t.blocks_skipped)
        yield self._labelled("ember_kv_transfer_fallbacks", "Prompts computed here instead "
                             "of pulled, by reason", "reason",
                             {r: 0 for r in FALLBACK_REASONS} | t.fallbacks)

    def _labelled(self, name: str, doc: str, label: str, values: dict[str, float]
                  ) -> CounterMetricFamily:
        counter = CounterMetricFamily(name, doc, labels=["model_name", label])
        for key, value in values.items():
            counter.add_metric([self.model_name, key], value)
        return counter

    def _load_phases(self, seconds: dict[str, float]) -> GaugeMetricFamily:
        """Start-up time by phase (engine/cold_start.py), the process's own first."""
        gauge = GaugeMetricFamily("ember_load_phase_seconds", "Seconds the server's start "
                                  "took, by phase", labels=["phase"])
        if self.engine.process_s is not None:
            gauge.add_metric(["process"], self.engine.process_s)
        for phase, value in seconds.items():
            gauge.add_metric([phase], value)
        return gauge

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric([self.model_name], value)
        return counter

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge


class ServerMetrics:
    """The request metrics. With tenants, each carries a `tenant` label; its values are the
    tenants of the keys file, so the label stays bounded. Without tenants the label is left
    out, so scrapers and dashboards of a keyless server see the same series as before."""

    def __init__(self, engine: AsyncEngine, model_name: str, tenants: tuple[str, ...] = ()
                 ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        t = ("tenant",) if tenants else ()
        self.ttft = Histogram("ember_time_to_first_token_seconds", "Time from the request's "
                              "arrival to its first token", t, buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("ember_inter_token_latency_seconds", "Gap between consecutive "
                             "pieces of one choice's output", t, buckets=LATENCY_BUCKETS,
                             registry=r)
        self.tpot = Histogram("ember_time_per_output_token_seconds", "Per choice: (E2E - TTFT) "
                              "/ (output tokens - 1)", t, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ember_e2e_request_latency_seconds", "Time from the request's "
                             "arrival to its end", t, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("ember_request_queue_time_seconds", "Time waiting before the "
                               "first step", t, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram("ember_request_prompt_tokens", "Prompt length per request",
                                    t, buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram("ember_request_generation_tokens", "Generated tokens per "
                                 "request", t, buckets=TOKEN_BUCKETS, registry=r)
        self.finished = Counter("ember_request_success", "Requests finished, by finish reason",
                                ("finish_reason", *t), registry=r)
        self.aborted = Counter("ember_request_aborts", "Requests aborted, by reason",
                               ("reason", *t), registry=r)
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens processed", t,
                                     registry=r)
        self.generation_tokens = Counter("ember_generation_tokens", "Tokens generated", t,
                                         registry=r)
        self.lora_requests = Counter("ember_lora_requests", "Requests finished per LoRA "
                                     "adapter", ("adapter",), registry=r)
        self.lora_prompt_tokens = Counter("ember_lora_prompt_tokens", "Prompt tokens processed "
                                          "per LoRA adapter", ("adapter",), registry=r)
        self.lora_generation_tokens = Counter("ember_lora_generation_tokens", "Tokens generated "
                                              "per LoRA adapter", ("adapter",), registry=r)
        self.tenants = frozenset(tenants)
        for tenant in tenants:  # every tenant's series exists from the start, at zero
            for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_len,
                           self.gen_len, self.prompt_tokens, self.generation_tokens):
                metric.labels(tenant)
        r.register(EngineCollector(engine, model_name))

    def tracker(self, arrival: float, tenant: str | None = None) -> "RequestTracker":
        """Timings of one request that arrived at `arrival` (time.monotonic)."""
        labels = {"tenant": tenant or ""} if self.tenants else {}
        return RequestTracker(self, arrival, labels)


@dataclass
class ChoiceTimes:
    first: float      # when this choice's first token was handed to the response
    last: float       # when its latest was
    num_tokens: int


class RequestTracker:
    """Timings of one HTTP request, reported to the metrics once it ends.

    TTFT and E2E run from the request's arrival, so parsing, templating and tokenizing count;
    ITL and TPOT are per choice, so n > 1 does not divide one choice's time by all tokens.
    """

    def __init__(self, metrics: ServerMetrics, arrival: float, labels: dict[str, str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.labels = labels
        self.clock = clock
        self.start = arrival
        self.first: float | None = None
        self.choices: dict[int, ChoiceTimes] = {}
        self.done = False
        self.adapter: str | None = None   # the LoRA adapter the request runs with

    def _of(self, metric: MetricWrapperBase, **labels: str) -> MetricWrapperBase:
        labels |= self.labels
        return metric.labels(**labels) if labels else metric

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    def on_output(self, index: int, num_tokens: int) -> None:
        """Choice `index` has just handed `num_tokens` new tokens to the response."""
        if num_tokens <= 0:
            return
        now = self.clock()
        if self.first is None:
            self.first = now
            self._of(self.metrics.ttft).observe(now - self.start)
        choice = self.choices.get(index)
        if choice is None:
            self.choices[index] = ChoiceTimes(now, now, num_tokens)
        else:
            self._of(self.metrics.itl).observe(now - choice.last)
            choice.last = now
            choice.num_tokens += num_tokens
        self._of(self.metrics.generation_tokens).inc(num_tokens)  # as it streams: rate() is live
        if self.adapter is not None:
            self.metrics.lora_generation_tokens.labels(self.adapter).inc(num_tokens)

    def on_finish(self, finish_reasons: list[str], num_prompt_tokens: int,
                  queue_times: list[float]) -> None:
        m, self.done = self.metrics, True
        self._of(m.e2e).observe(self.clock() - self.start)
        for choice in self.choices.values():
            if choice.num_tokens > 1:
                self._of(m.tpot).observe((choice.last - choice.first) / (choice.num_tokens - 1))
        for q in queue_times:
            self._of(m.queue).observe(q)
        for reason in finish_reasons:
            self._of(m.finished, finish_reason=reason).inc()
        self._of(m.prompt_len).observe(num_prompt_tokens)
        self._of(m.gen_len).observe(self.num_output_tokens)
        self._of(m.prompt_tokens).inc(num_prompt_tokens)
        if self.adapter is not None:
            m.lora_requests.labels(self.adapter).inc()
            m.lora_prompt_tokens.labels(self.adapter).inc(num_prompt_tokens)

    def on_abort(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self._of(self.metrics.aborted, reason=reason).inc()
