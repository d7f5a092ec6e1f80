"""Data sovereignty of `ember control` under random plane failures: three local planes (eu-1,
eu-2, us-1; simulated replicas), an eu-only tenant (acme) and an any-region tenant (globex)
streaming completions through the control endpoint while planes are killed (SIGKILL: the
agent and its fleets) and restarted at times drawn from `--seed`.

Where each request was processed is read from every plane's own gateway counters
(`ember_router_requests_total{tenant=...}`, `ember_router_tenant_requests_total`, and the
keys it refused, `ember_router_rejected_total{reason="unauthorized"}`), not from
the control plane's: each fleet's /metrics is scraped while it lives (a killed fleet's last
scrape counts) and at the end. It prints, as JSON, the eu-only tenant's requests processed on
us-1 (must be 0), each tenant's answers by status, requests lost before their first token,
503s, and how many of the requests answered 200 the planes' counters account for.

Not a test: `PYTHONPATH=. python benchmarks/control_sovereignty.py [--seed 1] [--duration 60]`
(tests/control/test_sovereignty.py runs a short one)."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ember.weights.paths import default_model_path
from tests.control.test_control_processes import (ACME, CONFIG, GLOBEX, Cluster, ready,
                                                  start_cluster)

REGIONS = {"eu-1": "eu", "eu-2": "eu", "us-1": "us"}
TENANTS = {"acme": ACME, "globex": GLOBEX}       # acme: eu only; globex: anywhere
FAILED_PAUSE_S = 0.25     # a client waits this long after a failed request, not spinning


@dataclass(frozen=True)
class Kill:
    at_s: float          # from the start of the load
    plane: str
    down_s: float        # restarted this long after


def draw_kills(seed: int, duration_s: float, gap_s: tuple[float, float],
               down_s: tuple[float, float]) -> list[Kill]:
    """A reproducible schedule: a plane is killed only while it is up, and never the last
    one up (the any-region tenant always has somewhere to go)."""
    rng = random.Random(seed)
    kills: list[Kill] = []
    back_at = {name: 0.0 for name in REGIONS}
    t = rng.uniform(*gap_s)
    while t < duration_s:
        up = sorted(n for n, back in back_at.items() if back <= t)
        if len(up) > 1:
            kill = Kill(round(t, 2), rng.choice(up), round(rng.uniform(*down_s), 2))
            back_at[kill.plane] = t + kill.down_s
            kills.append(kill)
        t += rng.uniform(*gap_s)
    return kills


class Tally:
    """Every fleet's counters as last scraped, summed over the fleet's restarts: a counter
    that went down belongs to a new process on the same URL."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.plane_of: dict[str, str] = {}                    # fleet URL -> plane
        self.last: dict[tuple[str, str, tuple], float] = {}   # (url, metric, labels) -> value
        self.base: Counter = Counter()

    def fleets(self, snap: dict) -> None:
        with self.lock:
            for p in snap["planes"]:
                for f in p["fleets"]:
                    self.plane_of[f["url"]] = p["name"]

    def scrape(self, urls: list[str]) -> None:
        for url in urls:
            try:
                text = httpx.get(url + "/metrics", timeout=2).text
            except httpx.HTTPError:
                continue                      # dead or draining: its last scrape stands
            with self.lock:
                for family in text_string_to_metric_families(text):
                    if family.name not in ("ember_router_requests",
                                           "ember_router_tenant_requests",
                                           "ember_router_rejected"):
                        continue
                    for s in family.samples:
                        if not s.name.endswith("_total"):
                            continue
                        key = (url, family.name, tuple(sorted(s.labels.items())))
                        if s.value < self.last.get(key, 0.0):
                            self.base[key] += self.last[key]
                        self.last[key] = s.value

    def urls(self, plane: str | None = None) -> list[str]:
        with self.lock:
            return [u for u, p in self.plane_of.items() if plane in (None, p)]

    def per_plane(self) -> dict[str, dict]:
        """plane -> {tenant: {"answered_200", "reached"}, "refused_keys": n}."""
        out: dict = {p: {t: {"answered_200": 0.0, "reached": 0.0} for t in TENANTS}
                     | {"refused_keys": 0.0} for p in REGIONS}
        with self.lock:
            for key, value in self.last.items():
                url, metric, labels = key
                labels = dict(labels)
                total = value + self.base[key]
                if metric == "ember_router_rejected":
                    if labels["reason"] == "unauthorized":
                        out[self.plane_of[url]]["refused_keys"] += total
                    continue
                row = out[self.plane_of[url]].setdefault(
                    labels["tenant"], {"answered_200": 0.0, "reached": 0.0})
                if metric == "ember_router_tenant_requests":
                    row["reached"] += total
                elif labels["status"] == "200":
                    row["answered_200"] += total
        return out


class Scraper(threading.Thread):
    def __init__(self, c: Cluster, tally: Tally, every_s: float) -> None:
        super().__init__(daemon=True)
        self.c, self.tally, self.every_s = c, tally, every_s
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.tally.fleets(self.c.snapshot())
            except (httpx.HTTPError, ValueError):
                pass
            self.tally.scrape(self.tally.urls())


class Load:
    """Per tenant, `per_tenant` threads streaming completions, each sent as the last ends
    (FAILED_PAUSE_S later after a failure); each answer counted by status, and as lost when
    it failed before its first token."""

    def __init__(self, url: str, model: str, per_tenant: int) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {t: Counter() for t in TENANTS}
        self.threads = [threading.Thread(target=self.run, args=(t,), daemon=True)
                        for t in TENANTS for _ in range(per_tenant)]
        for t in self.threads:
            t.start()

    def run(self, tenant: str) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                outcome = self.one(client, TENANTS[tenant])
                with self.lock:
                    self.counts[tenant].update(outcome)
                if "lost_before_first_token" in outcome:
                    self.stop.wait(FAILED_PAUSE_S)

    def one(self, client: httpx.Client, headers: dict) -> list[str]:
        first = False
        status = "error"
        try:
            with client.stream("POST", self.url + "/v1/completions", headers=headers,
                               json={"model": self.model, "prompt": "Hello",
                                     "max_tokens": 8, "stream": True}) as r:
                status = str(r.status_code)
                for line in r.iter_lines():
                    first = first or (r.status_code == 200 and line.startswith("data"))
        except httpx.HTTPError:
            pass
        return [f"status_{status}", "first_token" if first else "lost_before_first_token"]

    def end(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        return {t: {"requests": sum(v for k, v in c.items() if k.startswith("status_")),
                    "first_token": c["first_token"],
                    "lost_before_first_token": c["lost_before_first_token"],
                    "status_503": c["status_503"],
                    "by_status": {k[7:]: v for k, v in sorted(c.items())
                                  if k.startswith("status_")}}
                for t, c in self.counts.items()}


def wait_ready(c: Cluster, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            snap = c.snapshot()
            if ready(snap, "chat-eu") and ready(snap, "chat-us"):
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the deployments never got ready")
        time.sleep(0.2)


def chaos(c: Cluster, tally: Tally, kills: list[Kill], duration_s: float) -> None:
    """Kill and restart planes on the schedule, measured from now."""
    t0 = time.monotonic()
    restarts: list[tuple[float, str]] = []
    pending = list(kills)
    while time.monotonic() - t0 < duration_s:
        now = time.monotonic() - t0
        for at, name in [r for r in restarts if r[0] <= now]:
            c.planes[name] = c.start_plane(name, REGIONS[name])
            restarts.remove((at, name))
        if pending and pending[0].at_s <= now:
            kill = pending.pop(0)
            tally.scrape(tally.urls(kill.plane))    # its counters die with it
            c.planes[kill.plane].end(signal.SIGKILL)
            restarts.append((now + kill.down_s, kill.plane))
        time.sleep(0.05)
    for _, name in restarts:                       # leave every plane up at the end
        c.planes[name] = c.start_plane(name, REGIONS[name])


def run(folder: Path, seed: int, duration_s: float, per_tenant: int,
        gap_s: tuple[float, float], down_s: tuple[float, float]) -> dict:
    kills = draw_kills(seed, duration_s, gap_s, down_s)
    c = start_cluster(folder, default_model_path(), CONFIG)
    try:
        wait_ready(c)
        tally = Tally()
        tally.fleets(c.snapshot())
        scraper = Scraper(c, tally, 0.25)
        scraper.start()
        load = Load(c.url, c.model, per_tenant)
        chaos(c, tally, kills, duration_s)
        client = load.end()
        scraper.stop.set()
        scraper.join(30)
        tally.fleets(c.snapshot())
        tally.scrape(tally.urls())
        planes = tally.per_plane()
        return {"seed": seed, "duration_s": duration_s, "concurrency": 2 * per_tenant,
                "kills": [vars(k) for k in kills],
                "eu_only_on_us1": planes["us-1"]["acme"],
                "keys_refused_on_us1": planes["us-1"]["refused_keys"],
                "client": client, "planes": planes,
                "counted_by_planes_200": {
                    t: sum(planes[p][t]["answered_200"] for p in planes) for t in TENANTS},
                "control_served": c.snapshot()["served"],
                "load_average": os.getloadavg()}
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=60, metavar="S")
    ap.add_argument("--per-tenant", type=int, default=4, help="streams per tenant")
    ap.add_argument("--gap", type=float, nargs=2, default=(4, 10), metavar=("MIN", "MAX"),
                    help="seconds between kills")
    ap.add_argument("--down", type=float, nargs=2, default=(3, 8), metavar=("MIN", "MAX"),
                    help="seconds a killed plane stays down")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        result = run(Path(folder), args.seed, args.duration, args.per_tenant,
                     tuple(args.gap), tuple(args.down))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
