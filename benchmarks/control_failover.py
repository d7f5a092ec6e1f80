"""Failover of `ember control` with three local planes (eu-1, eu-2, us-1; simulated replicas,
or with --real the default model, its weight cache and kernels warm):
kill one plane under streamed load and print how soon traffic moves, how soon its replicas
are re-placed and ready, and how many requests were lost before their first token.

    active-active  chat-eu on eu-1 and eu-2; eu-1 is killed (SIGKILL: agent and fleets)
    active-passive chat on one eu plane, its standby on the other; the primary is killed

Not a test: `PYTHONPATH=. python benchmarks/control_failover.py [--concurrency 8] [--real]`."""
from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ember.weights.paths import default_model_path, served_model_name
from tests.control.test_control_processes import (ACME, CONFIG, PASSIVE, Cluster, ready,
                                                  start_cluster)


class Load:
    """`concurrency` threads streaming completions without pause; counts, per request, an
    answer that fails before its first token as lost."""

    def __init__(self, url: str, model: str, concurrency: int) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.ok = self.lost = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True)
                        for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                first = False
                try:
                    with client.stream("POST", self.url + "/v1/completions", headers=ACME,
                                       json={"model": self.model, "prompt": "Hello",
                                             "max_tokens": 8, "stream": True}) as r:
                        for line in r.iter_lines():
                            first = first or (r.status_code == 200 and line.startswith("data"))
                except httpx.HTTPError:
                    pass
                with self.lock:
                    self.ok += first
                    self.lost += not first

    def end(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        return {"requests": self.ok + self.lost, "lost_before_first_token": self.lost}


def until(c, predicate, timeout_s: float = 120) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate(c.snapshot()):
                return time.monotonic()
        except httpx.TransportError:     # the control plane is still starting
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the control plane never got there")
        time.sleep(0.05)


def cluster(folder: Path, template: str, real: bool) -> Cluster:
    """Three local planes serving `template`'s deployments: simulated replicas, or the
    default model itself (the template's serve_args without --simulate)."""
    if not real:
        return start_cluster(folder, default_model_path(), template)
    return Cluster(folder, folder / "no-profile", served_model_name(None),
                   template.replace('"--simulate", "{profile}", ', ""))


def replicas_ready(snap: dict, plane: str, deployment: str) -> int:
    """How many replicas of the plane's fleet of `deployment` answer (the fleet's own
    /fleet): a fleet counts as ready once one replica does."""
    fleets = [f for p in snap["planes"] if p["name"] == plane for f in p["fleets"]
              if f["deployment"] == deployment]
    if not fleets:
        return 0
    replicas = httpx.get(fleets[0]["url"] + "/fleet", headers=ACME, timeout=10).json()["replicas"]
    return sum(r["state"] == "ready" for r in replicas)


def active_active(folder: Path, concurrency: int, real: bool) -> dict:
    c = cluster(folder, CONFIG, real)
    try:
        until(c, lambda s: ready(s, "chat-eu") and ready(s, "chat-us"))
        load = Load(c.url, c.model, concurrency)
        time.sleep(3)
        eu2 = c.snapshot()["served"]["acme"].get("eu-2", 0)
        t0 = time.monotonic()
        c.planes["eu-1"].end(signal.SIGKILL)
        down = until(c, lambda s: any(p["name"] == "eu-1" and p["health"] == "down"
                                      for p in s["planes"]))
        replaced = until(c, lambda s: next(
            d for d in s["deployments"] if d["name"] == "chat-eu")["placement"]["active"]
            == {"eu-2": 2} and replicas_ready(s, "eu-2", "chat-eu") == 2)
        time.sleep(2)
        served = c.snapshot()["served"]["acme"]
        return {"eu1_marked_down_s": round(down - t0, 2),
                "replaced_and_ready_s": round(replaced - t0, 2),
                "served_on_eu2_after_kill": served.get("eu-2", 0) - eu2, **load.end()}
    finally:
        c.close()


def active_passive(folder: Path, concurrency: int, real: bool) -> dict:
    c = cluster(folder, PASSIVE, real)
    try:
        until(c, lambda s: ready(s, "chat") and all(
            p["fleets"] and p["fleets"][0]["ready"] for p in s["planes"]
            if p["name"] in ("eu-1", "eu-2")))
        where = c.snapshot()["deployments"][0]["placement"]
        [primary], standby = list(where["active"]), where["standby"]
        load = Load(c.url, c.model, concurrency)
        time.sleep(3)
        t0 = time.monotonic()
        c.planes[primary].end(signal.SIGKILL)
        serves = until(c, lambda s: s["served"].get("acme", {}).get(standby, 0) > 0)
        promoted = until(c, lambda s: s["deployments"][0]["placement"]["active"]
                         == {standby: 1})
        time.sleep(2)
        return {"standby_serves_s": round(serves - t0, 2),
                "standby_promoted_s": round(promoted - t0, 2), **load.end()}
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--real", action="store_true",
                    help="replicas of the default model instead of simulated ones")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        result = {"concurrency": args.concurrency, "real": args.real,
                  "active_active": active_active(Path(a), args.concurrency, args.real),
                  "active_passive": active_passive(Path(b), args.concurrency, args.real),
                  "load_average": os.getloadavg()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
