"""Resident memory of `ember serve`: idle after loading, under load, and idle again.

    .venv/bin/python benchmarks/serve_memory.py [--out FILE]

Starts `ember serve` (the default model and KV budget unless --serve-args says otherwise),
reads VmRSS from /proc/PID/status every 0.2 s, and drives it with `ember bench serve`: the
standard concurrency-32 workload (64 requests, input U(100,400), output U(64,192); --rounds
times, other seeds), then one 1024-token prompt. Reports MB (10^6 bytes) and GiB: after
loading (once the idle engine has faulted its KV cache in), the highest sample under load,
after the burst (the engine hands freed memory back when it goes idle), and VmHWM (the peak
over the process's life, loading included). Linux only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ember.bench.cli import results_dir
from ember.bench.peers import Server, settle

VENV_BIN = Path(sys.executable).parent
GIB = 1 << 30


def status_kb(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ember serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("ember serve did not become ready")


class Sampler(threading.Thread):
    """The highest VmRSS seen while running."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kb, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_kb = max(self.peak_kb, status_kb(self.pid, "VmRSS"))
            time.sleep(0.2)


def bench(url: str, *args: str, seed: int = 0) -> dict:
    """One `ember bench serve` run against the server at `url`; its summary. Raises unless
    every request completed (a load that failed is no load)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        subprocess.run([str(VENV_BIN / "ember"), "bench", "serve", "--base-url", url + "/v1",
                        "--seed", str(seed), "--extra-body", '{"logit_bias": {"2": -100}}',
                        "--out", str(out), *args], check=True, stdout=subprocess.DEVNULL)
        summary = json.loads(out.read_text())
    if summary["completed"] != summary["num_requests"]:
        raise SystemExit(f"ember bench serve: {summary['completed']} of "
                         f"{summary['num_requests']} requests completed ({summary['errors']})")
    return summary


def figures(kb: int) -> dict[str, float]:
    return {"mb": round(kb * 1024 / 1e6, 1), "gib": round(kb * 1024 / GIB, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve-args", default="", help="extra `ember serve` options")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the concurrency-32 workload this many times, seeds 0, 1, ...")
    out_dir = results_dir(os.environ, Path.home())  # never the tree
    parser.add_argument("--out", default=str(out_dir / "serve_memory.json"))
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(VENV_BIN / "ember"), "serve", "--port", str(port),
                             *shlex.split(args.serve_args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ.copy())
    try:
        wait_ready(url, proc)
        settle([Server("ember", "", port, proc)], timeout_s=60)  # its KV cache faulted in
        loaded = status_kb(proc.pid, "VmRSS")
        sampler = Sampler(proc.pid)
        sampler.start()
        tokens = 0
        for seed in range(args.rounds):
            tokens += bench(url, "--input-len", "uniform:100,400", "--output-len",
                            "uniform:64,192", "--num-requests", "64", "--concurrency", "32",
                            seed=seed)["output_tokens"]
        tokens += bench(url, "--input-len", "fixed:1024", "--output-len", "fixed:1",
                        "--num-requests", "1")["output_tokens"]
        sampler.stop.set()
        sampler.join()
        time.sleep(3)  # the engine goes idle and hands freed memory back
        result = {"serve_args": args.serve_args, "rounds": args.rounds,
                  "output_tokens": tokens,
                  "idle_after_load": figures(loaded),
                  "peak_under_load": figures(sampler.peak_kb),
                  "idle_after_load_test": figures(status_kb(proc.pid, "VmRSS")),
                  "vm_hwm": figures(status_kb(proc.pid, "VmHWM"))}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for name, value in result.items():
        if isinstance(value, dict):
            print(f"{name:22} {value['mb']:8.1f} MB  {value['gib']:.3f} GiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
