"""Soak: many concurrent streams for minutes, with clients that hang up or time out.

Targets an `ember serve` or an `ember route` gateway on 127.0.0.1 (--base-url), or starts one
(--start: `ember serve`; --start-route N: `ember route --replicas N`). Every request ends in
exactly one bucket: finished (a whole answer), error (a 4xx/5xx with a body), aborted (we hung
up mid-stream on purpose), timed_out (our client timeout fired), or LOST (none of these: a stream
that stopped without [DONE], a dropped connection we did not cause, a malformed answer). LOST
must be 0, and once idle the KV cache must be empty (the /metrics usage gauge at 0).

Through a gateway (a server whose GET /fleet lists replicas) the idle check reads each
replica's own gauges, the gateway's ejection and restart counters must stay at 0, and the
resident memory of the gateway and of each replica is reported (start, end, and the largest
of one sample a second).

    python benchmarks/soak.py --start --minutes 2
    python benchmarks/soak.py --start-route 2 --minutes 3
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

    def record(self, outcome: str) -> None:
        """One request's bucket: finished, aborted, timed_out, error:STATUS or lost:WHY."""
        kind, _, detail = outcome.partition(":")
        if kind == "error":
            self.errors[detail] += 1
        elif kind == "lost":
            self.lost += 1
            if len(self.lost_examples) < 10:
                self.lost_examples.append(detail)
        else:
            setattr(self, kind, getattr(self, kind) + 1)

    @property
    def num_recorded(self) -> int:
        return self.finished + self.aborted + self.timed_out + self.lost + \
            sum(self.errors.values())


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
    # the outcome is noted as soon as the answer is judged: a timeout or an error while the
    # connection closes afterwards does not count the request twice
    judged: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            await send(client, base_url + path, body, abort_after, judged)
    except TimeoutError:
        pass
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:  # dropped or malformed
        judged.append(f"lost:{path} stream={body['stream']}: {type(e).__name__}: {e}")
    tally.record(judged[0] if judged else "timed_out")


async def send(client: httpx.AsyncClient, url: str, body: dict, abort_after: int | None,
               judged: list[str]) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            data = json.loads(await r.aread())
            judged.append(f"error:{r.status_code}" if "message" in data.get("error", {})
                          else f"lost:{r.status_code} without an error envelope: {data}")
            return
        if not body["stream"]:
            data = json.loads(await r.aread())
            judged.append("finished" if data["choices"][0].get("finish_reason") is not None
                          else f"lost:non-streamed answer without finish_reason: {data}")
            return
        await read_stream(r, abort_after, judged)


async def read_stream(r: httpx.Response, abort_after: int | None, judged: list[str]) -> None:
    chunks, done, finish = 0, False, None
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        data = json.loads(line[6:])
        if "error" in data:       # an error after the headers went out: the stream's own report
            judged.append("error:stream_error")
            return
        chunks += 1
        for choice in data.get("choices", []):
            finish = choice.get("finish_reason") or finish
        if abort_after is not None and chunks >= abort_after:
            judged.append("aborted")   # leaving the block closes the connection mid-stream
            return
    judged.append("finished" if done and finish is not None else
                  f"lost:stream ended after {chunks} chunks: done={done} finish={finish}")


async def worker(base_url: str, seed: int, deadline: float, args: argparse.Namespace,
                 tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
        while time.monotonic() < deadline:
            await one_request(client, base_url, rng, args, tally)


GAUGES = ("ember_num_requests_running", "ember_num_requests_waiting",
          "ember_kv_cache_usage_perc")


async def read_gauges(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url + "/metrics")).text
    return {n: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            for n in GAUGES if line.startswith(n + " ") or line.startswith(n + "{")}


async def wait_idle(engines: dict[str, str], timeout_s: float) -> dict[str, dict[str, float]]:
    """Each engine's gauges (name -> URL) once nothing runs or waits in any of them (or
    whatever they read at the timeout)."""
    end = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            gauges = {name: await read_gauges(client, url) for name, url in engines.items()}
            if all(g.get(n, 1) == 0 for g in gauges.values() for n in GAUGES) or \
                    time.monotonic() > end:
                return gauges
            await asyncio.sleep(0.5)


def fleet_of(base_url: str) -> dict | None:
    """The gateway's GET /fleet, or None if the target is a single server."""
    try:
        r = httpx.get(base_url + "/fleet", timeout=10)
        return r.json() if r.status_code == 200 and "replicas" in r.json() else None
    except (httpx.HTTPError, ValueError):
        return None


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:   # exited (a replica restarted, say)
        return None
    return None


@dataclass
class Memory:
    """One process's resident set over the run, in KiB."""

    pid: int | None
    start: int | None = None
    end: int | None = None
    peak: int = 0
    each_minute: list = field(default_factory=list)   # from the start, then the end

    def sample(self, keep: bool = False) -> None:
        rss = rss_kib(self.pid)
        self.end = rss
        if rss is not None:
            self.start = rss if self.start is None else self.start
            self.peak = max(self.peak, rss)
        if keep:
            self.each_minute.append(rss)

    def report(self) -> dict:
        change = None if not (self.start and self.end) else \
            round(100 * (self.end - self.start) / self.start, 1)
        return {"pid": self.pid, "rss_kib_start": self.start, "rss_kib_end": self.end,
                "rss_kib_max": self.peak or None, "change_pct": change,
                "rss_kib_each_minute": self.each_minute}


async def sample_memory(memory: dict[str, Memory], stop: asyncio.Event) -> None:
    """Every process's RSS once a second until `stop`, kept each minute and at the end."""
    started, num_kept = time.monotonic(), 0
    while not stop.is_set():
        keep = (time.monotonic() - started) // 60 >= num_kept
        num_kept += keep
        for m in memory.values():
            m.sample(keep)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    for m in memory.values():
        m.sample(keep=True)


def gateway_counters(base_url: str) -> dict:
    """The gateway's answers by status, ejections, restarts and its own refusals."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict = {"answers_by_status": Counter(), "ejections": 0.0, "restarts": 0.0,
                 "rejected_by_gateway": 0.0}
    for line in text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("ember_router_requests_total{"):
            out["answers_by_status"][line.split('status="')[1].split('"')[0]] += float(value)
        elif line.startswith("ember_router_ejections_total"):
            out["ejections"] += float(value)
        elif line.startswith("ember_router_replica_restarts_total"):
            out["restarts"] += float(value)
        elif line.startswith("ember_router_rejected_total"):
            out["rejected_by_gateway"] += float(value)
    out["answers_by_status"] = dict(out["answers_by_status"])
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Until the server is ready and, for a gateway, every replica it lists."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                fleet = fleet_of(url)
                if fleet is None or all(r["state"] == "ready" for r in fleet["replicas"]):
                    return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fleet = ["route", "--replicas", str(args.start_route)] if args.start_route else ["serve"]
    command = [sys.executable, "-m", "ember.cli", *fleet, "--host", "127.0.0.1",
               "--port", str(port), "-q", *args.serve_args]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    if wait_ready(url, proc, args.start_timeout):
        return proc, url
    proc.kill()
    raise SystemExit(f"the server did not become ready: {' '.join(command)}")


async def soak(base_url: str, args: argparse.Namespace, pid: int | None) -> dict:
    tally = Tally()
    fleet = fleet_of(base_url)
    replicas = {r["id"]: r for r in fleet["replicas"]} if fleet else {}
    memory = {"gateway" if fleet else "server": Memory(pid)} | \
        {rid: Memory(r["pid"]) for rid, r in replicas.items()}
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(memory, stop))
    started = time.monotonic()
    deadline = started + args.minutes * 60
    workers = [worker(base_url, args.seed + i, deadline, args, tally)
               for i in range(args.concurrency)]
    await asyncio.wait_for(asyncio.gather(*workers), args.minutes * 60 + args.request_timeout + 30)
    engines = {rid: r["url"] for rid, r in replicas.items()} or {"server": base_url}
    gauges = await wait_idle(engines, 60)
    stop.set()
    await sampler
    report = {"base_url": base_url, "minutes": args.minutes, "concurrency": args.concurrency,
              "seconds": round(time.monotonic() - started, 1), "sent": tally.sent,
              "finished": tally.finished, "aborted_by_client": tally.aborted,
              "client_timeouts": tally.timed_out, "errors_by_status": dict(tally.errors),
              "LOST": tally.lost + (tally.sent - tally.num_recorded),
              "lost_examples": tally.lost_examples, "idle_gauges": gauges,
              "kv_all_free_when_idle": all(g.get("ember_kv_cache_usage_perc") == 0
                                           for g in gauges.values()),
              "memory": {name: m.report() for name, m in memory.items()}}
    if fleet:
        after = {r["id"]: r for r in fleet_of(base_url)["replicas"]}
        report["gateway"] = gateway_counters(base_url) | {
            "replicas_replaced": sorted(rid for rid, r in replicas.items()
                                        if after.get(rid, {}).get("pid") != r["pid"])}
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server on 127.0.0.1")
    target.add_argument("--start", action="store_true", help="start `ember serve` here")
    target.add_argument("--start-route", type=int, metavar="N",
                        help="start `ember route --replicas N` here")
    p.add_argument("--pid", type=int, help="the target server's or gateway's process (for "
                   "RSS; a gateway's replicas are found in its /fleet)")
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
    p.add_argument("serve_args", nargs="*", help="after --: options for `ember serve` (or "
                   "`ember route`, which passes them on to its replicas)")
    args = p.parse_args(argv)
    if args.base_url and not args.base_url.startswith(("http://127.0.0.1", "http://localhost")):
        p.error("--base-url must be on 127.0.0.1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proc, pid, url = None, args.pid, args.base_url
    if args.start or args.start_route:
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
    harmed = report.get("gateway", {})
    sys.exit(1 if report["LOST"] or not report["kv_all_free_when_idle"] or harmed.get("ejections")
             or harmed.get("restarts") or harmed.get("replicas_replaced") else 0)


if __name__ == "__main__":
    main()
