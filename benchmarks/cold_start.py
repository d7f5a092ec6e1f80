"""`ember serve` from process start to /health/ready and to its first token, in phases: the
server's own (ember_load_phase_seconds: process, files, kernels, weights, kv_cache,
calibrate, cache_write, warm_up), the process's CPU seconds until ready, and the machine's
load average at each start; then the median of the starts that found the weight cache.

    python benchmarks/cold_start.py --runs 5 [--xdg-cache-home DIR] [-- ember serve options]

Without --xdg-cache-home the cache lives in a fresh temporary $XDG_CACHE_HOME, so the first
start is cold (it loads the model file and writes the cache) and the others read it; with
it, a cache already there is used from the first start. The compiled kernels come from
$TORCH_EXTENSIONS_DIR as usual (build them once first: a start that builds them measures the
compiler). On a shared machine, `nice -n -20` in front keeps other jobs from taking the
server's cores (the benchmark's processes inherit it).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phases(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ember_load_phase_seconds{"):
            name = line.split('phase="', 1)[1].split('"', 1)[0]
            out[name] = round(float(line.rsplit(" ", 1)[1]), 3)
    return out


def wait_ready(proc: subprocess.Popen, url: str, started: float, timeout_s: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError("never ready")
        time.sleep(0.01)


def first_token_s(url: str, started: float) -> float:
    """Seconds from the process's start to the first streamed token of a short request."""
    body = {"prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


def one_start(options: list[str], env: dict[str, str], timeout_s: float) -> dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--port", str(port),
                             "-q", *options], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, url, started, timeout_s)
        ready_s = time.perf_counter() - started
        cpu_s = cpu_seconds(proc.pid)
        first_s = first_token_s(url, started)
        seen = phases(url)
        return {"kind": "cold" if "cache_write" in seen else "cached",
                "ready_s": round(ready_s, 3), "first_token_s": round(first_s, 3),
                "cpu_s": round(cpu_s, 2), "load_1m": load, "phases": seen}
    finally:
        proc.terminate()
        proc.wait(60)


def summary(runs: list[dict]) -> dict[str, object]:
    """Medians over the starts that read the weight cache."""
    cached = [r for r in runs if r["kind"] == "cached"]
    if not cached:
        return {}
    names = dict.fromkeys(name for r in cached for name in r["phases"])
    return {"cached_starts": len(cached),
            **{key: round(statistics.median(r[key] for r in cached), 3)
               for key in ("ready_s", "first_token_s", "cpu_s", "load_1m")},
            "phases": {n: round(statistics.median(r["phases"].get(n, 0.0) for r in cached), 3)
                       for n in names}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4, help="starts, the first one included")
    parser.add_argument("--xdg-cache-home", help="keep the weight cache here (default: a fresh "
                        "temporary folder, so the first start is cold)")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", help="also write the runs and their summary here as JSON")
    parser.add_argument("serve_options", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    options = [o for o in args.serve_options if o != "--"]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "XDG_CACHE_HOME": args.xdg_cache_home or scratch}
        for _ in range(args.runs):
            run = one_start(options, env, args.timeout_s)
            print(json.dumps(run), flush=True)
            runs.append(run)
    result = summary(runs)
    print(json.dumps({"median": result}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "median": result}, f, indent=1)


if __name__ == "__main__":
    main()
