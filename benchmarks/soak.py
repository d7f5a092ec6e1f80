"""Soak: many concurrent streams for minutes, with clients that hang up or time out.

Targets an `ember serve` on 127.0.0.1 (--base-url) or starts one (--start). Every request ends in
exactly one bucket: finished (a whole answer), error (a 4xx/5xx with a body), aborted (we hung
up mid-stream on purpose), timed_out (our client timeout fired), or LOST (none of these: a stream
that stopped without [DONE], a dropped connection we did not cause, a malformed answer). LOST
must be 0, and once idle the KV cache must be empty (the /metrics usage gauge at 0).

    python benchmarks/soak.py --start --minutes 2
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --pid 1234

Prints one JSON object. Loops stop by themselves: each worker at the deadline, the whole run
at the deadline plus a grace period.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROMPTS = ["Tell me a story about a lighthouse.", "List five fruits.", "What is 12 * 7?",
           "Write a limerick about a cat.", "Explain rain to a child.", "Say hello in French."]


@dataclass
class Tally:
    sent: int = 0
    finished: int = 0
    aborted: int = 0
    timed_out: int = 0
    lost: int = 0
    errors: Counter = field(default_factory=Counter)
    lost_examples: list = field(default_factory=list)

    def lose(self, why: str) -> None:
        self.lost += 1
        if len(self.lost_examples) < 10:
            self.lost_examples.append(why)


def random_body(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """A completions or chat body, streamed or not, with a small answer length."""
    stream = rng.random() < 0.7
    common = {"max_tokens": rng.randint(1, max_tokens), "stream": stream,
              "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": rng.choice(PROMPTS), **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                  rng.choice(PROMPTS)}], **common}


async def one_request(client: httpx.AsyncClient, base_url: str, rng: random.Random,
                      args: argparse.Namespace, tally: Tally) -> None:
    path, body = random_body(rng, args.max_tokens)
    roll = rng.random()
    abort_after = rng.randint(0, 4) if roll < args.abort_fraction else None
    timeout = (rng.uniform(0.05, 1.0) if args.abort_fraction <= roll
               < args.abort_fraction + args.timeout_fraction else args.request_timeout)
    tally.sent += 1
    try:
        async with asyncio.timeout(timeout):
            await send(client, base_url + path, body, abort_after, tally)
    except TimeoutError:
        tally.timed_out += 1
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:  # dropped or malformed
        tally.lose(f"{path} stream={body['stream']}: {type(e).__name__}: {e}")


async def send(client: httpx.AsyncClient, url: str, body: dict, abort_after: int | None,
               tally: Tally) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            data = json.loads(await r.aread())
            if "message" not in data.get("error", {}):
                tally.lose(f"{r.status_code} without an error envelope: {data}")
            tally.errors[str(r.status_code)] += 1
            return
        if not body["stream"]:
            data = json.loads(await r.aread())
            if data["choices"][0].get("finish_reason") is None:
                tally.lose(f"non-streamed answer without finish_reason: {data}")
            else:
                tally.finished += 1
            return
        await read_stream(r, abort_after, tally)


async def read_stream(r: httpx.Response, abort_after: int | None, tally: Tally) -> None:
    chunks, done, finish = 0, False, None
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        data = json.loads(line[6:])
        if "error" in data:       # an error after the headers went out: the stream's own report
            tally.errors["stream_error"] += 1
            return
        chunks += 1
        for choice in data.get("choices", []):
            finish = choice.get("finish_reason") or finish
        if abort_after is not None and chunks >= abort_after:
            tally.aborted += 1    # leaving the block closes the connection mid-stream
            return
    if done and finish is not None:
        tally.finished += 1
    else:
        tally.lose(f"stream ended after {chunks} chunks: done={done} finish={finish}")


async def worker(base_url: str, seed: int, deadline: float, args: argparse.Namespace,
                 tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
        while time.monotonic() < deadline:
            await one_request(client, base_url, rng, args, tally)


async def wait_idle(base_url: str, timeout_s: float) -> dict[str, float]:
    """The engine gauges once nothing runs or waits (or whatever they read at the timeout)."""
    names = ("ember_num_requests_running", "ember_num_requests_waiting",
             "ember_kv_cache_usage_perc")
    end = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            text = (await client.get(base_url + "/metrics")).text
            gauges = {n: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      for n in names if line.startswith(n + " ") or line.startswith(n + "{")}
            if all(gauges.get(n, 1) == 0 for n in names) or time.monotonic() > end:
                return gauges
            await asyncio.sleep(0.5)


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ember.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "-q", *args.serve_args]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + args.start_timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become ready: {' '.join(command)}")


async def soak(base_url: str, args: argparse.Namespace, pid: int | None) -> dict:
    tally = Tally()
    rss_start = rss_kib(pid)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    workers = [worker(base_url, args.seed + i, deadline, args, tally)
               for i in range(args.concurrency)]
    await asyncio.wait_for(asyncio.gather(*workers), args.minutes * 60 + args.request_timeout + 30)
    gauges = await wait_idle(base_url, 60)
    accounted = tally.finished + tally.aborted + tally.timed_out + sum(tally.errors.values())
    return {"base_url": base_url, "minutes": args.minutes, "concurrency": args.concurrency,
            "seconds": round(time.monotonic() - started, 1), "sent": tally.sent,
            "finished": tally.finished, "aborted_by_client": tally.aborted,
            "client_timeouts": tally.timed_out, "errors_by_status": dict(tally.errors),
            "LOST": tally.lost + (tally.sent - accounted - tally.lost),
            "lost_examples": tally.lost_examples, "idle_gauges": gauges,
            "kv_all_free_when_idle": gauges.get("ember_kv_cache_usage_perc") == 0,
            "rss_kib_start": rss_start, "rss_kib_end": rss_kib(pid)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server on 127.0.0.1")
    target.add_argument("--start", action="store_true", help="start `ember serve` here")
    p.add_argument("--pid", type=int, help="the target server's process (for RSS)")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--abort-fraction", type=float, default=0.2,
                   help="requests we hang up on mid-stream")
    p.add_argument("--timeout-fraction", type=float, default=0.1,
                   help="requests with a short client timeout (0.05-1 s)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs="*", help="after --: options for `ember serve`")
    args = p.parse_args(argv)
    if args.base_url and not args.base_url.startswith(("http://127.0.0.1", "http://localhost")):
        p.error("--base-url must be on 127.0.0.1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proc, pid, url = None, args.pid, args.base_url
    if args.start:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        report = asyncio.run(soak(url, args, pid))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(report, indent=2))
    sys.exit(1 if report["LOST"] or not report["kv_all_free_when_idle"] else 0)


if __name__ == "__main__":
    main()
