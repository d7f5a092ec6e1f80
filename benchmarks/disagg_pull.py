"""Pulls between real replicas: one `--role prefill` and two `--role decode` servers (one
pulling through shared memory, one over HTTP), the default model, long prompts.

    .venv/bin/python benchmarks/disagg_pull.py [--tokens 4000] [--prompts 2] [--out FILE]

Each prompt (a different stretch of the bench corpus, so no cache holds it) goes to the
prefill replica with kv_transfer_params {do_remote_decode: true}, then with the answer's
transfer parameters to each decode replica in turn (the prefill replica computes it once
per decode replica). Reported from the decode replicas' /metrics: bytes pulled and seconds
from claim to release (so HTTP round trips count), as GB/s; and each decode request's time
to its answer, beside the prefill replica's time to its first token.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ember.bench.workloads import default_corpus

ROLES = {"prefill": ["--role", "prefill"], "shm": ["--role", "decode"],
         "http": ["--role", "decode", "--kv-transport", "http"]}


def start(port: int, extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--port", str(port),
                             "-q", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited")
        try:
            if httpx.get(url + "/health/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} never became ready")


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if re.match(re.escape(name) + r"[{ ]", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompts(tokens: int, count: int) -> list[str]:
    words = default_corpus().split()
    size = int(tokens * 0.75)   # ~1.3 tokens a word of this corpus
    return [" ".join(words[i * size:(i + 1) * size]) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    urls = {role: f"http://127.0.0.1:{args.port + i}" for i, role in enumerate(ROLES)}
    procs = {role: start(args.port + i, extra) for i, (role, extra) in enumerate(ROLES.items())}
    try:
        for role, url in urls.items():
            wait_ready(url, procs[role])
        rows = []
        greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
        for text in prompts(args.tokens, args.prompts):
            for decode in ("shm", "http"):
                start_s = time.monotonic()
                first = httpx.post(urls["prefill"] + "/v1/completions", timeout=600, json={
                    "prompt": text, "kv_transfer_params": {"do_remote_decode": True}} | greedy
                ).json()
                prefill_s = time.monotonic() - start_s
                start_s = time.monotonic()
                rest = httpx.post(urls[decode] + "/v1/completions", timeout=600, json={
                    "prompt": text, "kv_transfer_params": first["kv_transfer_params"]} | greedy
                ).json()
                rows.append({"decode": decode, "prompt_tokens": rest["usage"]["prompt_tokens"],
                             "prefill_s": prefill_s, "decode_s": time.monotonic() - start_s})
        summary = {}
        for decode in ("shm", "http"):
            nbytes = metric(urls[decode], "ember_kv_transfer_bytes_total")
            seconds = metric(urls[decode], "ember_kv_transfer_seconds_total")
            fallbacks = metric(urls[decode], "ember_kv_transfer_fallbacks_total")
            summary[decode] = {"bytes": nbytes, "seconds": seconds,
                               "gbps": nbytes / seconds / 1e9 if seconds else None,
                               "fallbacks": fallbacks}
        result = {"cpu": platform.processor() or platform.machine(), "requests": rows,
                  "pulls": summary}
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)


if __name__ == "__main__":
    main()
