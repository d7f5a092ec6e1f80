"""Capacity search over simulated fleets: the replicas a rate needs within an SLO, the highest
rate a fleet holds, a capacity curve, and what a million output tokens cost.

Every answer is a simulation (simulate.py) of the same requests and the same seeded arrivals,
so two fleets differ only in what the fleet does with them. The searches assume what holds
for a fleet that balances its load: more replicas never make the SLO harder to meet, and a
higher rate never makes it easier.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ember.bench.metrics import per_request, summarize
from ember.plan.simulate import FleetSim, FleetStats, Load, ReplicaConfig, SimRequest


@dataclass(frozen=True)
class Slo:
    """Latency limits (bench's parse_slo), and the share of requests that must meet the
    per-request ones (the percentile targets hold for the run as a whole)."""

    limits: dict[str, float]
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not self.limits:
            raise ValueError("an SLO needs at least one limit, e.g. ttft_p99=1s,itl_p99=100ms")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment={self.attainment} must be in (0, 1]")

    def met(self, summary: dict[str, Any]) -> bool:
        if any(not t["met"] for t in (summary.get("slo_percentiles") or {}).values()):
            return False
        if per_request(self.limits):
            return summary["goodput"]["fraction"] >= self.attainment
        return summary["completed"] == summary["num_requests"]   # no request refused


@dataclass
class Point:
    """One simulated fleet at one load."""

    replicas: int
    rate: float | None
    summary: dict[str, Any]
    stats: FleetStats
    meets: bool

    def to_json(self) -> dict[str, Any]:
        s, st = self.summary, self.stats
        return {"replicas": self.replicas, "rate": self.rate, "meets_slo": self.meets,
                "utilisation": st.utilisation, "mean_batch": _mean(st.mean_batch),
                "kv_usage_mean": _mean(st.mean_kv_usage), "kv_usage_peak": max(st.peak_kv_usage),
                "preemptions": sum(st.preemptions),
                "prefix_hit_rate": st.prefix_hit_tokens / st.prefix_query_tokens
                if st.prefix_query_tokens else 0.0,
                "requests_per_replica": st.requests_per_replica, "summary": s}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


LoadFor = Callable[[float | None], Load]


class Planner:
    """Simulates the workload on fleets of any size, at any rate (each answer kept)."""

    def __init__(self, config: ReplicaConfig, requests: Sequence[SimRequest], load_for: LoadFor,
                 slo: Slo | None, policy: str, token_ids: Sequence[int], seed: int = 0) -> None:
        self.config = config
        self.requests = list(requests)
        self.load_for = load_for
        self.slo = slo
        self.policy = policy
        self.token_ids = token_ids
        self.seed = seed
        self.points: dict[tuple[int, float | None], Point] = {}

    def simulate(self, replicas: int, rate: float | None) -> Point:
        key = (replicas, rate)
        if key not in self.points:
            sim = FleetSim(self.config, replicas, self.policy, self.token_ids, self.seed)
            records = sim.run(self.requests, self.load_for(rate))
            summary = summarize(records, self.slo.limits if self.slo else None)
            meets = self.slo.met(summary) if self.slo else True
            self.points[key] = Point(replicas, rate, summary, sim.stats(), meets)
        return self.points[key]

    def replicas_needed(self, rate: float | None, max_replicas: int) -> Point | None:
        """The smallest fleet that meets the SLO at `rate` (doubling, then bisecting); None
        if `max_replicas` do not."""
        high = 1
        while not self.simulate(high, rate).meets:
            if high >= max_replicas:
                return None
            high = min(2 * high, max_replicas)
        low = high // 2   # misses (or 0)
        while high - low > 1:
            mid = (low + high) // 2
            if self.simulate(mid, rate).meets:
                high = mid
            else:
                low = mid
        return self.simulate(high, rate)

    def max_rate(self, replicas: int, start: float, tolerance: float = 0.03) -> Point | None:
        """The highest rate (within `tolerance`, relative) at which `replicas` meet the SLO;
        None if they miss it even at start / 2**10."""
        low, high = None, None
        rate = start
        for _ in range(24):   # bracket: [a rate that meets, one that misses]
            if self.simulate(replicas, rate).meets:
                low, rate = rate, rate * 2
            else:
                high, rate = rate, rate / 2
            if low is not None and high is not None:
                break
            if high is not None and rate < start / 2**10:
                return None
        if low is None or high is None:
            return None if low is None else self.simulate(replicas, low)
        while (high - low) / low > tolerance:
            mid = math.sqrt(low * high)
            if self.simulate(replicas, mid).meets:
                low = mid
            else:
                high = mid
        return self.simulate(replicas, low)

    def curve(self, replicas: int, rates: Sequence[float]) -> list[Point]:
        return [self.simulate(replicas, r) for r in rates]


def cost_per_million(point: Point, cost_per_hour: float) -> float:
    """Dollars (or any unit) per million output tokens: the fleet's cost per hour over the
    output tokens it makes in an hour."""
    tok_per_s = point.summary["output_tok_per_s"]
    if not tok_per_s or math.isnan(tok_per_s):
        return math.nan
    return point.replicas * cost_per_hour / (tok_per_s * 3600) * 1e6
