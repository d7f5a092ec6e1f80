"""`ember serve` from process start to /health/ready: cold (no weight cache) then warm (the
cache the cold start wrote), with the server's own phases (ember_load_phase_seconds), the
process's CPU seconds until ready, and the machine's load average beside each run.

    python benchmarks/cold_start.py --warm-runs 3 [-- extra ember serve options]

The cache lives in a fresh temporary $XDG_CACHE_HOME, so the first run is cold whatever the
user's cache holds; the compiled kernels come from $TORCH_EXTENSIONS_DIR as usual (build them
once first: a start that builds them measures the compiler).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
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
    """User + system CPU seconds of a live process (Linux /proc)."""
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


def one_start(options: list[str], env: dict[str, str], timeout_s: float) -> dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--port", str(port),
                             "-q", *options], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ember serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError("never ready")
            time.sleep(0.02)
        ready_s = time.perf_counter() - started
        cpu_s = cpu_seconds(proc.pid)
        return {"ready_s": round(ready_s, 3), "cpu_s": round(cpu_s, 2), "load_1m": load,
                "phases": phases(url)}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", help="also write the runs here as JSON")
    parser.add_argument("serve_options", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    options = [o for o in args.serve_options if o != "--"]
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        for kind in ["cold"] + ["warm"] * args.warm_runs:
            run = {"kind": kind, **one_start(options, env, args.timeout_s)}
            print(json.dumps(run), flush=True)
            runs.append(run)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
