"""The control endpoint's added latency: TTFT of streamed completions at concurrency 8 sent
straight to a plane's fleet gateway and through `ember control`, in alternated rounds of one
run (direct first in even rounds, control first in odd ones), so both see the same machine.

One local plane runs the deployment's one replica of the default model (`--simulate PROFILE`
for a simulated one). Prints, as JSON, each path's TTFT p50 over all rounds, each round's,
and the added p50 in ms.

With --split-cores the replica runs on core 1 (`--cpu-bind 1`) and the control plane and
this client on core 0, as where the control plane has a machine of its own: on two cores
shared by all, its hop's CPU competes with the replica's own step.

Not a test: `PYTHONPATH=. python benchmarks/control_hop.py [--rounds 6] [--requests 48]
[--split-cores]`."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from ember.weights.paths import served_model_name
from tests.control.test_control_processes import Proc
from tests.server.conftest import free_port

CONFIG = """
[[deployment]]
name = "chat"
model = "{model}"
replicas = 1
cores = 1
memory_gib = 1
mode = "active-passive"
serve_args = {serve_args}
"""


async def ttft(client: httpx.AsyncClient, url: str, model: str, i: int) -> float:
    """Seconds from sending to the first streamed token. The stream is read to its end: a
    client hanging up early would abort the request, and the abort travels one hop more
    through the control plane, leaving its steps in the replica's batch a little longer."""
    body = {"model": model, "prompt": f"Request {i}: tell me about the sea.",
            "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{url}: a stream with no token")
    return first


async def phase(url: str, model: str, requests: int, concurrency: int) -> list[float]:
    """`requests` TTFTs, `concurrency` in flight at a time."""
    queue = list(range(requests))
    out: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        async def worker() -> None:
            while queue:
                out.append(await ttft(client, url, model, queue.pop()))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def wait_fleet(control_url: str, timeout_s: float = 900) -> str:
    """The fleet's URL once the deployment is ready (a real replica loading on busy cores
    takes minutes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            snap = httpx.get(control_url + "/control", timeout=10).json()
            fleets = [f for p in snap["planes"] for f in p["fleets"] if f["ready"]]
            if fleets and all(d["state"] == "ready" for d in snap["deployments"]):
                return fleets[0]["url"]
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the deployment never got ready")


def measure(paths: dict[str, str], model: str, rounds: int, requests: int,
            concurrency: int) -> dict:
    per_round: dict[str, list[float]] = {name: [] for name in paths}
    every: dict[str, list[float]] = {name: [] for name in paths}
    for url in paths.values():                      # warm both paths (connections, caches)
        asyncio.run(phase(url, model, concurrency, concurrency))
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            times = asyncio.run(phase(paths[name], model, requests, concurrency))
            per_round[name].append(round(1000 * statistics.median(times), 2))
            every[name] += times
    p50 = {name: round(1000 * statistics.median(t), 2) for name, t in every.items()}
    return {"ttft_p50_ms": p50, "per_round_p50_ms": per_round,
            "added_p50_ms": round(p50["control"] - p50["direct"], 2),
            "added_p50_ms_median_of_rounds": round(statistics.median(
                c - d for c, d in zip(per_round["control"], per_round["direct"])), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=48, help="per path and round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--simulate", metavar="PROFILE", help="a simulated replica (no weights)")
    ap.add_argument("--split-cores", action="store_true",
                    help="the replica on core 1, the control plane and the client on core 0")
    args = ap.parse_args()
    if args.simulate:      # the profile names the model its replicas serve
        from ember.plan.profile import load_profile
        model = load_profile(args.simulate).model_name
    else:
        model = served_model_name(None)
    serve_args = ["--simulate", args.simulate] if args.simulate else []
    if args.split_cores:
        serve_args += ["--cpu-bind", "1"]
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "deployments.toml"
        config.write_text(CONFIG.format(model=model, serve_args=json.dumps(serve_args)))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        control = Proc("control", "--config", str(config), "--state",
                       str(Path(folder) / "c.db"), "--port", str(port))
        plane = Proc("plane", "--name", "eu-1", "--region", "eu", "--cores", "2",
                     "--memory-gib", "4", "--control", url)
        try:
            if args.split_cores:
                for pid in (0, control.proc.pid):
                    os.sched_setaffinity(pid, {0})
            fleet = wait_fleet(url)
            result = measure({"direct": fleet, "control": url}, model, args.rounds,
                             args.requests, args.concurrency)
        finally:
            plane.end()
            control.end()
    print(json.dumps({"concurrency": args.concurrency, "rounds": args.rounds,
                      "requests_per_round": args.requests, "model": model,
                      "simulated": bool(args.simulate), "split_cores": args.split_cores,
                      **result,
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
