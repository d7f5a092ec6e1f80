"""`ember bench peers`: ember beside peer servers, identical workloads, run alternately.

Starts `ember serve` and each peer command the user gives (with {port} and {model} filled in)
on 127.0.0.1, waits until each answers /v1/models, then runs the same requests against each
in turn, --repeats times, and prints ember's ratio to every peer. It runs only the commands it
is given: it never downloads or builds anything.
"""
from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ember.bench import report


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
        peers.append((name, command))
    return peers


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_speed = sorted(runs, key=lambda s: s["output_tok_per_s"])
    return by_speed[len(by_speed) // 2]


def run_peers(args: argparse.Namespace) -> None:
    from ember.bench.commands import build_requests, run_once
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
        ember = servers[0]
        requests = build_requests(args, ember.base_url, ember.model)
        for repeat in range(args.repeats):
            for server in servers:
                summary, records = run_once(args, server.base_url, requests, server.model,
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
    out.write_text(json.dumps({"model_file": model_file, "commands": {
        s.name: s.command for s in servers}, "median": medians, "runs": runs}, indent=2))
    for name in medians:
        if name != "ember":
            print(f"\n== ember vs {name} (ratio = ember / {name}) ==")
            print(report.compare([(name, medians[name]), ("ember", medians["ember"])]))
    print(f"wrote {out}")
