"""Autoscaling on the gateway's own counters.

Every `interval_s` the loop samples the primary group's load (requests in flight on its
replicas + requests held waiting for one). `decide` turns the samples of the look-back window
into a desired replica count: ceil(mean load / target_ongoing), within [min, max]; zero only
after `scale_to_zero_after_s` without a request. A change applies only once it has been
wanted for the scale-up (or scale-down) delay, so a short burst or lull does not flap.
Scaling down drains the least loaded replica (no new routes, in-flight requests finish).
A request arriving at a fleet of zero asks for a replica at once (`on_demand`).
In a disaggregated fleet each role has its own autoscaler, over its own replicas, with its
own bounds (`role`), and counts the requests held for a replica of that role.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ember.router.config import AutoscaleConfig
from ember.router.fleet import Fleet
from ember.router.replicas import ReplicaState

log = logging.getLogger(__name__)
LIVE = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DEAD)


@dataclass(frozen=True)
class Sample:
    time: float
    load: float            # in flight + held, for the whole group
    ttft_s: float | None = None


def decide(samples: list[Sample], cfg: AutoscaleConfig, now: float,
           last_request_at: float) -> int:
    """The replica count the window asks for (pure: the loop applies delays and acts)."""
    window = [s for s in samples if s.time >= now - cfg.look_back_s]
    mean = sum(s.load for s in window) / len(window) if window else 0.0
    desired = math.ceil(mean / cfg.target_ongoing - 1e-9)
    ttfts = [s.ttft_s for s in window if s.ttft_s is not None]
    if cfg.ttft_slo_s is not None and ttfts and sorted(ttfts)[len(ttfts) // 2] > cfg.ttft_slo_s:
        desired += 1
    idle = now - last_request_at
    if desired == 0 and (cfg.scale_to_zero_after_s is None
                         or idle < cfg.scale_to_zero_after_s):
        desired = 1
    return max(cfg.min_replicas, min(cfg.max_replicas, desired))


class Autoscaler:
    def __init__(self, fleet: Fleet, cfg: AutoscaleConfig, held: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, role: str = "both") -> None:
        self.fleet = fleet
        self.role = role                       # the primary replicas it scales: this role's
        self.clock = clock
        self.cfg = cfg
        self.held = held                       # requests held by the proxy, now
        self.samples: deque[Sample] = deque()
        # a fleet that starts at zero stays there until its first request
        idle = (cfg.scale_to_zero_after_s or 0.0) if not self.live() else 0.0
        self.last_request_at = clock() - idle
        self.wanted_since: tuple[str, float] | None = None
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=256)   # (when, seconds)
        self._task: asyncio.Task | None = None

    def note_request(self, ttft_s: float | None = None) -> None:
        self.last_request_at = self.clock()
        if ttft_s is not None:
            self.ttfts.append((self.last_request_at, ttft_s))

    def median_ttft(self, now: float) -> float | None:
        """The median replica TTFT over the look-back window: an old slow answer must not
        keep asking for a replica (nor keep an idle fleet from reaching zero)."""
        while self.ttfts and self.ttfts[0][0] < now - self.cfg.look_back_s:
            self.ttfts.popleft()
        recent = sorted(ttft for _, ttft in self.ttfts)
        return recent[len(recent) // 2] if recent else None

    def live(self) -> list:
        return self.fleet.group("primary", LIVE, None if self.role == "both" else (self.role,))

    def on_demand(self, group: str, roles: tuple[str, ...] | None = None) -> None:
        """A request is waiting and the group has no live replica (of `roles`): start one
        now."""
        if roles is not None and self.role not in roles:
            return
        self.last_request_at = self.clock()
        if group == "primary" and not self.live():
            self.scale("up", "demand")
        elif group != "primary" and not self.fleet.group(group, LIVE):
            self.fleet.start_replica(group)

    def scale(self, direction: str, reason: str) -> None:
        if direction == "up":
            replica = self.fleet.start_replica("primary", self.role)
            if replica is None:
                return
            target = replica.id
        else:
            ready = [r for r in self.live() if r.state is ReplicaState.READY] or self.live()
            if not ready:
                return
            victim = min(ready, key=lambda r: (r.in_flight, r.id))
            self.fleet.drain_soon(victim)
            target = victim.id
        self.fleet.metrics.scale_events.labels(direction).inc()
        log.info("scale %s (%s): replica %s; %d live%s", direction, reason, target,
                 len(self.live()), "" if self.role == "both" else f" {self.role} replicas")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                self.step(self.clock())
            except Exception:
                log.exception("autoscaler step failed")
            await asyncio.sleep(self.cfg.interval_s)

    def step(self, now: float) -> None:
        load = sum(r.in_flight for r in self.live()) + self.held()
        if load:
            self.last_request_at = now
        self.samples.append(Sample(now, load, self.median_ttft(now)))
        while self.samples and self.samples[0].time < now - self.cfg.look_back_s:
            self.samples.popleft()
        desired = decide(list(self.samples), self.cfg, now, self.last_request_at)
        current = len(self.live())
        if desired == current:
            self.wanted_since = None
            return
        direction = "up" if desired > current else "down"
        if self.wanted_since is None or self.wanted_since[0] != direction:
            self.wanted_since = (direction, now)   # the delay runs while the direction holds
        delay = self.cfg.scale_up_delay_s if direction == "up" else self.cfg.scale_down_delay_s
        if current == 0 or desired == 0:
            delay = 0.0   # work waits on a cold fleet, or the idle time has already passed
        if now - self.wanted_since[1] >= delay:
            for _ in range(current if desired == 0 else 1):
                self.scale(direction, "idle" if desired == 0 else "load")
            self.wanted_since = None
