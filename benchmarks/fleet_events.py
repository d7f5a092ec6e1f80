"""The fleet's two event runs through `ember route`:

    python benchmarks/fleet_events.py scale-from-zero [--cycles 2] [-- ember serve options]
    python benchmarks/fleet_events.py failover [-- ember serve options]

scale-from-zero: a gateway with no replica (--replicas 0 --min-replicas 0 --max-replicas 1
--scale-to-zero-after S) gets a burst of streamed requests (sent by this script); it holds
them, starts one replica, and answers them. Reported per cycle: errors, the first token as
the client saw it beside the replica's ready time (both from the burst's start, which
launches the replica), and the replica's cold start in phases (GET /fleet). Between cycles
the fleet idles until it is back at zero replicas.

failover: two replicas under `ember bench serve`'s streamed requests; once the victim is serving
some, it is killed with SIGKILL. Reported: requests lost before their first token (must be
0: those are retried on the other replica), streams cut after it (each ended with an SSE
error event), retries by reason, and whether the victim came back.

Writes the bench's own results beside --out (default: a temporary folder) and prints one
JSON line per cycle or run, with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ember(*args: str) -> list[str]:
    return [sys.executable, "-m", "ember.cli", *args]


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def fleet(url: str) -> dict:
    return httpx.get(url + "/fleet", timeout=10).json()


def ready_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def states(url: str) -> list[str]:
    return [r["state"] for r in fleet(url)["replicas"]]


def bench(url: str, out: Path, args: argparse.Namespace) -> subprocess.Popen:
    return subprocess.Popen(ember("bench", "serve", "--base-url", url + "/v1",
                                  "--num-requests", str(args.num_requests), "--concurrency",
                                  str(args.concurrency), "--input-len",
                                  f"fixed:{args.input_len}", "--output-len",
                                  f"fixed:{args.output_len}", "--out", str(out)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]


def retries(url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ember_router_retries_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = found.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return found


def streamed(url: str, prompt: str, max_tokens: int, started: float) -> dict:
    """One streamed completion: seconds from `started` to its first token, or its error."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return {"error": f"http_{r.status_code}"}
            first = None
            for line in r.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - started
                if line.startswith("event: error"):
                    return {"error": "stream_error", "first_token_s": first}
            return {"error": None, "first_token_s": first}
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}


def scale_from_zero(args: argparse.Namespace, url: str, out_dir: Path) -> None:
    """Bursts sent by this script (not `ember bench`, whose clock starts after it has asked
    the gateway for the model's name, which waits for the replica too)."""
    for cycle in range(args.cycles):
        wait_for(lambda: all(s in ("stopped", "dead") for s in states(url)), 600,
                 "the fleet to scale to zero")
        load = os.getloadavg()[0]
        started = time.perf_counter()
        prompts = [f"Request {i} of a burst: tell me about the sea." for i in
                   range(args.num_requests)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(streamed, url, p, args.output_len, started)
                       for p in prompts]
            results = [f.result() for f in futures]
        live = [r for r in fleet(url)["replicas"] if r["state"] == "ready"]
        cold = live[0]["cold_start"] if live else {}
        firsts = [r["first_token_s"] for r in results if r.get("first_token_s") is not None]
        first = min(firsts, default=None)
        ready = cold.get("ready_s")
        print(json.dumps({"run": "scale-from-zero", "cycle": cycle, "load_1m": load,
                          "requests": len(results),
                          "errors": sum(r["error"] is not None for r in results),
                          "first_token_s": None if first is None else round(first, 3),
                          "replica_ready_s": ready,
                          "first_token_after_ready_s": None if first is None or ready is None
                          else round(first - ready, 3),
                          "replica_first_byte_s": cold.get("first_byte_s"),
                          "phases": cold.get("phases")}), flush=True)
        time.sleep(1)


def failover(args: argparse.Namespace, url: str, out_dir: Path) -> None:
    wait_for(lambda: states(url).count("ready") == 2, 600, "two ready replicas")
    load = os.getloadavg()[0]
    out = out_dir / "failover.json"
    run = bench(url, out, args)
    victim: dict = {}

    def serving() -> bool:
        busy = [r for r in fleet(url)["replicas"] if r["state"] == "ready" and r["in_flight"]]
        victim.update(busy[0] if len(busy) == 2 else {})
        return bool(victim)
    wait_for(serving, 600, "both replicas serving")
    time.sleep(args.kill_after)
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    if run.wait(1800) != 0:
        raise RuntimeError(run.stderr.read()[-2000:])
    recs = records(out)
    failed = [r for r in recs if r["error"] is not None]
    back = next(r for r in fleet(url)["replicas"] if r["id"] == victim["id"])
    print(json.dumps({"run": "failover", "load_1m": load, "requests": len(recs),
                      "ok": len(recs) - len(failed),
                      "lost_before_first_token": sum(r.get("ttft") is None for r in failed),
                      "streams_cut": sum(r.get("ttft") is not None for r in failed),
                      "errors": sorted({r["error"] for r in failed}),
                      "victim_in_flight_when_killed": victim["in_flight"],
                      "retries": retries(url), "victim_state": back["state"],
                      "victim_restarts": back["restarts"],
                      "seconds_since_kill": round(time.monotonic() - killed_at, 1)}),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", choices=["scale-from-zero", "failover"])
    parser.add_argument("--cycles", type=int, default=2, help="scale-from-zero: bursts")
    parser.add_argument("--scale-to-zero-after", type=float, default=15.0)
    parser.add_argument("--num-requests", type=int, default=None,
                        help="default: 8 (scale-from-zero), 48 (failover)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="default: 8 (scale-from-zero), 8 (failover)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="tokens per answer (default: 16, 96 for failover)")
    parser.add_argument("--input-len", type=int, default=512,
                        help="failover: prompt tokens (long enough that some requests are in "
                        "their prompt when the replica dies)")
    parser.add_argument("--kill-after", type=float, default=0.5,
                        help="failover: seconds after both replicas serve")
    parser.add_argument("--out", default=None, help="folder for the bench results")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    options = argv[split + 1:]   # after `--`: options of the replicas' `ember serve`
    failing = args.run == "failover"
    args.num_requests = args.num_requests or (48 if failing else 8)
    args.concurrency = args.concurrency or 8
    args.output_len = args.output_len or (96 if failing else 16)
    fleet_args = ["--replicas", "2", "--policy", "least-load"] if failing else \
        ["--replicas", "0", "--min-replicas", "0", "--max-replicas", "1",
         "--scale-to-zero-after", str(args.scale_to_zero_after)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as scratch:
        out_dir = Path(args.out or scratch)
        out_dir.mkdir(parents=True, exist_ok=True)
        log = open(out_dir / f"{args.run}-route.log", "w")
        route = subprocess.Popen(ember("route", *fleet_args, "--port", str(port), "-q",
                                       *options), stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_for(lambda: ready_ok(url), 120, "the gateway")
            (failover if failing else scale_from_zero)(args, url, out_dir)
        finally:
            route.send_signal(signal.SIGTERM)
            try:
                route.wait(120)
            except subprocess.TimeoutExpired:
                route.kill()


if __name__ == "__main__":
    main()
