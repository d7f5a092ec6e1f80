"""Rollouts: a canary share of traffic, blue-green promote/rollback, and shadow mirroring.

* canary (`--canary SPEC:PERCENT`): that share of requests goes to the "canary" group.
* promote: the canary group becomes the primary one; the old primaries drain (their
  in-flight requests finish) and stop. rollback: the canaries drain and stop. Either way no
  in-flight request is dropped, because draining only stops new routes.
* shadow (`--shadow SPEC:PERCENT`): a sample of requests is also sent, unstreamed, to the
  "shadow" group; its answers are discarded, it is left out of load accounting and
  autoscaling, and its latency and whether its greedy text matched are recorded.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field

import aiohttp

from ember.errors import ConfigError
from ember.router.fleet import Fleet
from ember.router.replicas import ReplicaState

log = logging.getLogger(__name__)


def parse_spec(text: str, option: str) -> tuple[str, float]:
    """'SPEC:PERCENT' -> (SPEC, percent); SPEC is a model path or a replica URL."""
    spec, sep, percent = text.rpartition(":")
    try:
        value = float(percent)
    except ValueError:
        value = -1.0
    if not sep or not spec or not 0 <= value <= 100:
        raise ConfigError(f"{option} {text!r} must be SPEC:PERCENT, SPEC a model path or a "
                          "replica URL and PERCENT in [0, 100], e.g. models/new.gguf:10")
    return spec, value


class Capture:
    """The text of a response as it passes (JSON, or SSE chunks), for shadow comparison."""

    LIMIT = 1 << 20

    def __init__(self) -> None:
        self.data = bytearray()
        self.done = asyncio.Event()

    def feed(self, chunk: bytes) -> None:
        if len(self.data) < self.LIMIT:
            self.data += chunk

    def close(self) -> None:
        self.done.set()

    def text(self) -> str | None:
        raw = bytes(self.data)
        if raw.startswith(b"data:"):
            parts = []
            for line in raw.split(b"\n"):
                if line.startswith(b"data: {"):
                    parts.append(choice_text(json.loads(line[6:])))
            return "".join(parts)
        try:
            return choice_text(json.loads(raw))
        except ValueError:
            return None


def choice_text(payload: dict) -> str:
    choices = payload.get("choices") or [{}]
    c = choices[0]
    if "text" in c:
        return c["text"] or ""
    part = c.get("message") or c.get("delta") or {}
    return part.get("content") or ""


@dataclass
class Rollout:
    canary_percent: float = 0.0
    shadow_percent: float = 0.0
    rng: random.Random = field(default_factory=random.Random)

    def group_for(self, fleet: Fleet) -> str:
        if self.canary_percent and fleet.can_serve_soon("canary") and \
                self.rng.random() * 100 < self.canary_percent:
            return "canary"
        return "primary"

    def shadow_wanted(self, fleet: Fleet) -> bool:
        return bool(self.shadow_percent) and self.rng.random() * 100 < self.shadow_percent \
            and bool(fleet.group("shadow", (ReplicaState.READY,)))

    async def promote(self, fleet: Fleet) -> dict:
        """Canaries become primaries; the old primaries drain and stop in the background."""
        canaries = fleet.group("canary")
        if not canaries:
            return {"promoted": 0}
        old = [r for r in fleet.group("primary") if r.state is not ReplicaState.DRAINING]
        for r in canaries:
            r.group = "primary"
        if "canary" in fleet.launchers:
            fleet.launchers["primary"] = fleet.launchers.pop("canary")
        self.canary_percent = 0.0
        for r in old:
            fleet.drain_soon(r)
        log.info("promoted %d canary replicas; draining %d old ones", len(canaries), len(old))
        return {"promoted": len(canaries), "draining": [r.id for r in old]}

    async def rollback(self, fleet: Fleet) -> dict:
        canaries = [r for r in fleet.group("canary") if r.state is not ReplicaState.DRAINING]
        fleet.launchers.pop("canary", None)
        self.canary_percent = 0.0
        for r in canaries:
            fleet.drain_soon(r)
        log.info("rolled back: draining %d canary replicas", len(canaries))
        return {"rolled_back": len(canaries), "draining": [r.id for r in canaries]}

    async def mirror(self, fleet: Fleet, path: str, raw: bytes, headers: dict[str, str],
                     primary: Capture) -> None:
        """Send the request to a shadow replica and compare once both have answered."""
        shadows = fleet.group("shadow", (ReplicaState.READY,))
        if not shadows:
            return
        replica = self.rng.choice(shadows)
        body = json.loads(raw)
        greedy = body.get("temperature") == 0
        body["stream"] = False
        body.pop("stream_options", None)
        start = time.monotonic()
        try:
            async with fleet.session.post(replica.url + path, json=body, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=600)) as resp:
                payload = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            payload = None
        fleet.metrics.shadow_latency.observe(time.monotonic() - start)
        if payload is None:
            fleet.metrics.shadow.labels("error").inc()
            return
        await primary.done.wait()
        if not greedy:
            outcome = "not_greedy"
        else:
            outcome = "match" if choice_text(payload) == primary.text() else "mismatch"
        fleet.metrics.shadow.labels(outcome).inc()
