"""`ember bench peers`: ember beside peer servers, identical workloads, run alternately.

Starts `ember serve` and each peer command the user gives (with {port} and {model} filled in)
on 127.0.0.1, waits until each answers /v1/models and then until all are idle (settle), then
runs the same requests against each in turn, --repeats times, and prints ember's ratio to
every peer. It runs only the commands it is given: it never downloads or builds anything.

Repeats are paired: repeat r sends every server the same fresh requests (seed + r, so that no
server answers a repeat from its prefix cache), in an order that alternates from one repeat to
the next (ember first, then last), and ember's ratio to a peer is taken within each repeat.
The machine's speed drifts over minutes; a ratio of two runs made side by side moves much less
than either run, and the median of the paired ratios is the figure to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ember.bench import report
from ember.bench.drive import build_requests, run_once


@dataclass
class Server:
    name: str
    command: str
    port: int
    process: subprocess.Popen | None = None
    model: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, model_file: str, log_dir: Path, timeout_s: float) -> None:
    command = server.command.format(port=server.port, model=model_file)
    log = open(log_dir / f"{server.name}.log", "w")
    server.process = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited with {server.process.returncode}; see "
                             f"{log_dir / (server.name + '.log')}")
        if ready(server):
            return
        time.sleep(0.5)
    raise SystemExit(f"{server.name} did not answer /v1/models within {timeout_s:g} s")


def ready(server: Server) -> bool:
    """/health/ready answers 200 (or the server has no such route) and /v1/models names a
    model. A server may list its model before it can serve it, hence both."""
    root = server.base_url.removesuffix("/v1")
    try:
        if httpx.get(root + "/health/ready", timeout=5).status_code not in (200, 404):
            return False
        r = httpx.get(server.base_url + "/models", timeout=5)
        if r.status_code == 200:
            server.model = r.json()["data"][0]["id"]
            return True
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        pass
    return False


def cpu_seconds(pid: int) -> float | None:
    """The CPU time process `pid` has used (Linux /proc), or None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def settle(servers: list[Server], timeout_s: float, busy: float = 0.1,
           window_s: float = 1.0) -> bool:
    """Wait until every server is idle, each using under `busy` of a core over `window_s`:
    a server may go on working after it is ready (ember faults its KV cache in while idle,
    a few seconds of a core), and that work would land in the first repeat of the server
    run beside it. True once idle, False at `timeout_s` or where /proc is not readable."""
    pids = [s.process.pid for s in servers if s.process is not None]
    deadline = time.monotonic() + timeout_s
    before = [cpu_seconds(pid) for pid in pids]
    while time.monotonic() < deadline and None not in before:
        time.sleep(window_s)
        after = [cpu_seconds(pid) for pid in pids]
        if None in after:
            return False
        if all(b - a < busy * window_s for a, b in zip(before, after)):  # type: ignore[operator]
            return True
        before = after
    return False


def stop(server: Server) -> None:
    if server.process and server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()


def parse_peers(specs: list[str]) -> list[tuple[str, str]]:
    peers = []
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command:
            raise SystemExit(f"--peer-cmd {spec!r}: write NAME=COMMAND")
        if name == "ember" or name in (n for n, _ in peers):
            raise SystemExit(f"--peer-cmd {spec!r}: the name {name!r} is taken; give each peer "
                             "a name of its own (not 'ember')")
        peers.append((name, command))
    return peers


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_speed = sorted(runs, key=lambda s: s["output_tok_per_s"])
    return by_speed[len(by_speed) // 2]


def repeat_args(args: argparse.Namespace, repeat: int) -> argparse.Namespace:
    """The options of repeat `repeat`: the seed moved on by it (none stays none), so that each
    repeat sends requests that no server has cached yet."""
    seed = None if args.seed is None else args.seed + repeat
    return argparse.Namespace(**{**vars(args), "seed": seed})


def run_order(names: list[str], repeat: int) -> list[str]:
    """The servers in the order repeat `repeat` runs them: as given on even repeats, reversed
    on odd ones, so that neither side always runs first in a pair."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def paired_ratios(runs: dict[str, list[dict[str, Any]]], key: str = "output_tok_per_s"
                  ) -> dict[str, dict[str, Any]]:
    """For each peer: ember's `key` over the peer's, repeat by repeat, and their median."""
    out = {}
    for name, peer_runs in runs.items():
        if name == "ember":
            continue
        ratios = [e[key] / p[key] for e, p in zip(runs["ember"], peer_runs) if p[key]]
        if ratios:
            out[name] = {"key": key, "ratios": [round(r, 3) for r in ratios],
                         "median": round(statistics.median(ratios), 3)}
    return out


def run_peers(args: argparse.Namespace) -> None:
    model_file = args.model_file
    if model_file is None:
        from ember.weights.loader import default_model_path
        model_file = str(default_model_path())
    ember_cmd = (f"{shlex.quote(sys.executable)} -m ember.cli serve --model {{model}} "
                 f"--port {{port}} -q {args.ember_args}")
    servers = [Server("ember", ember_cmd, free_port())] + \
        [Server(name, cmd, free_port()) for name, cmd in parse_peers(args.peer_cmd)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    try:
        for server in servers:
            start(server, model_file, out.parent, args.ready_timeout)
        if not settle(servers, args.settle_timeout):
            print(f"the servers were still busy {args.settle_timeout:g} s after they were "
                  "ready; measuring anyway", file=sys.stderr)
        ember, by_name = servers[0], {s.name: s for s in servers}
        for repeat in range(args.repeats):
            rargs = repeat_args(args, repeat)
            requests = build_requests(rargs, ember.base_url, ember.model)
            for name in run_order(list(by_name), repeat):
                server = by_name[name]
                summary, records = run_once(rargs, server.base_url, requests, server.model,
                                            label=server.name)
                path = out.with_name(f"{out.stem}-{server.name}-{repeat}.json")
                summary["jsonl"] = str(path.with_suffix(".jsonl"))
                report.write_results(path, summary, records)
                runs[server.name].append(summary)
                print(report.table(summary))
    finally:
        for server in servers:
            stop(server)
    medians = {name: median_run(r) for name, r in runs.items()}
    paired = paired_ratios(runs)
    out.write_text(json.dumps({"model_file": model_file, "commands": {
        s.name: s.command for s in servers}, "median": medians, "paired": paired,
        "runs": runs}, indent=2))
    for name in medians:
        if name != "ember":
            print(f"\n== ember vs {name} (ratio = ember / {name}) ==")
            print(report.compare([(name, medians[name]), ("ember", medians["ember"])]))
            if name in paired and len(paired[name]["ratios"]) > 1:
                print(f"output tok/s, ember / {name} per repeat: {paired[name]['ratios']}; "
                      f"median {paired[name]['median']}")
    print(f"wrote {out}")
