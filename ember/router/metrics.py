"""The gateway's Prometheus metrics, in a registry of its own (no global state)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
COLD_START_BUCKETS = (0.5, 1, 2, 3, 5, 8, 12, 20, 30, 60, 120)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ANONYMOUS = "anonymous"            # the tenant of a request when keys name no tenants


class FleetCollector(Collector):
    """Replicas by state, each replica's load, and the fleet's totals under a replica's own
    gauge names, read from the fleet at scrape time."""

    def __init__(self, snapshot: Callable[[], list[dict]], held: Callable[[], int]) -> None:
        self.snapshot = snapshot
        self.held = held

    def collect(self) -> Iterator[Metric]:
        replicas = self.snapshot()
        yield from fleet_totals(replicas, self.held())
        yield GaugeMetricFamily("ember_router_held_requests", "Requests waiting for a ready "
                                "replica", value=self.held())
        by_state = GaugeMetricFamily("ember_router_replicas", "Replicas by state",
                                     labels=["state"])
        for state in ("starting", "ready", "draining", "stopped", "dead", "failed"):
            by_state.add_metric([state], sum(r["state"] == state for r in replicas))
        yield by_state
        for name, key, doc in (("in_flight", "in_flight", "Gateway requests on the replica"),
                               ("running", "running", "Requests running in the replica"),
                               ("waiting", "waiting", "Requests waiting in the replica"),
                               ("kv_usage", "kv_usage", "The replica's KV cache in use")):
            gauge = GaugeMetricFamily(f"ember_router_replica_{name}", doc, labels=["replica"])
            for r in replicas:
                gauge.add_metric([r["id"]], r[key])
            yield gauge


class AsideCollector(Collector):
    """A disaggregated fleet's mode, read at scrape time: whether it steps aside now, and
    how often it changed."""

    def __init__(self, view: Callable[[], dict]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view()
        yield GaugeMetricFamily("ember_router_disagg_stepped_aside", "1 while whole requests "
                                "may go to a replica of any role (no request worth splitting "
                                "for --disagg-idle-s), else 0", value=int(view["stepped_aside"]))
        changes = CounterMetricFamily("ember_router_disagg_mode_changes", "Changes of a "
                                      "disaggregated fleet's mode, by the mode changed to "
                                      "(aside, disaggregated)", labels=["to"])
        for mode, count in view["mode_changes"].items():
            changes.add_metric([mode], count)
        yield changes


def fleet_totals(replicas: list[dict], held: int) -> Iterator[Metric]:
    """`vllm:num_requests_running` and `vllm:num_requests_waiting` summed over the replicas
    that serve clients (not a shadow's mirrored copies), by model, the held requests counted
    as waiting for the primary replicas' model: dashboards and autoscalers made for one
    server read the fleet as one server."""
    serving = [r for r in replicas if r["group"] != "shadow"
               and r["state"] in ("ready", "draining")]
    primary = [r["model"] for r in replicas if r["group"] == "primary" and r["model"]]
    held_model = primary[0] if primary else ""
    models = sorted({r["model"] or "" for r in serving} | ({held_model} if held else set()))
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests running in the "
                                "fleet's replicas", labels=["model_name"])
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in the fleet's "
                                "replicas, and held by the gateway for one to be ready",
                                labels=["model_name"])
    for model in models:
        mine = [r for r in serving if (r["model"] or "") == model]
        running.add_metric([model], sum(r["running"] for r in mine))
        waiting.add_metric([model], sum(r["waiting"] for r in mine)
                           + (held if model == held_model else 0))
    yield running
    yield waiting


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], list[dict]], held: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # `tenant` (the name the request's key resolved to) says where each tenant's inputs
        # were processed, from the plane's own counters
        self.requests = Counter("ember_router_requests", "Requests answered, by replica, "
                                "HTTP status and tenant", ["replica", "status", "tenant"],
                                registry=r)
        self.tenant_requests = Counter("ember_router_tenant_requests", "Requests that reached "
                                       "this gateway, by tenant (anonymous without --api-keys)",
                                       ["tenant"], registry=r)
        self.decisions = Counter("ember_router_routing_decisions", "Routing decisions, by "
                                 "replica and reason", ["replica", "reason"], registry=r)
        self.retries = Counter("ember_router_retries", "Requests sent again to another "
                               "replica before their first byte, by reason", ["reason"],
                               registry=r)
        self.ejections = Counter("ember_router_ejections", "Replicas taken out of routing "
                                 "after a failure, by reason", ["replica", "reason"], registry=r)
        self.overlap = Histogram("ember_router_prefix_overlap_ratio", "Share of the prompt's "
                                 "blocks the chosen replica holds", ["replica"],
                                 buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.overhead = Histogram("ember_router_overhead_seconds", "Time from a request's "
                                  "arrival to its forwarding (parse, hash, pick)",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.scale_events = Counter("ember_router_scale_events", "Replicas started or stopped "
                                    "by the autoscaler", ["direction"], registry=r)
        self.restarts = Counter("ember_router_replica_restarts", "Dead replicas restarted",
                                registry=r)
        self.cold_start = Histogram("ember_router_cold_start_seconds", "From a replica's start "
                                    "to its first ready probe", buckets=COLD_START_BUCKETS,
                                    registry=r)
        self.event_polls_failed = Counter("ember_router_kv_event_polls_failed", "Polls of a "
                                          "replica's /kv/events that failed, by HTTP status "
                                          "(or timeout, error)", ["replica", "status"],
                                          registry=r)
        self.rejected = Counter("ember_router_rejected", "Requests refused by the gateway "
                                "itself, by reason", ["reason"], registry=r)
        self.stream_errors = Counter("ember_router_stream_errors", "Streams ended with an "
                                     "error event after bytes had been sent", registry=r)
        self.shadow = Counter("ember_router_shadow_requests", "Mirrored requests, by whether "
                              "the shadow's greedy output matched", ["outcome"], registry=r)
        self.shadow_latency = Histogram("ember_router_shadow_latency_seconds", "Mirrored "
                                        "requests' latency on the shadow",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.disagg_requests = Counter("ember_router_disagg_requests", "Requests of a "
                                       "disaggregated fleet, by path: prefill_decode (both "
                                       "stages), prefill_only (the first token ended it), "
                                       "kept_local (under --disagg-min-tokens), "
                                       "kept_local_backlog (every prefill replica backed up "
                                       "past --disagg-max-prefill-backlog), unsupported "
                                       "(what a transfer cannot carry), fallback (no prefill "
                                       "replica answered)", ["path"], registry=r)
        self.disagg_fallbacks = Counter("ember_router_disagg_fallbacks", "Requests sent whole "
                                        "to a decode replica because the prefill stage failed, "
                                        "by reason", ["reason"], registry=r)
        self.disagg_pins_released = Counter("ember_router_disagg_pins_released", "Prefill "
                                            "replicas' pins the gateway released (its client "
                                            "left, or no decode replica took the request)",
                                            registry=r)
        r.register(FleetCollector(snapshot, held))
