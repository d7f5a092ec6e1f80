"""`ember route` as a process over real `ember serve` replica processes (the tiny model):
failover when a replica is SIGKILLed under load, its restart, scale from zero, and a
replica of two tensor-parallel ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ember.router.fleet import PORT_TAKEN
from tests.server.conftest import TEST_KV_GIB, free_port
from tests.waiting import wait_for

REPLICA_OPTIONS = ["--dtype", "float32", "--kernels", "torch", "--max-model-len", "512", "-q",
                   "--kv-cache-gib", str(TEST_KV_GIB)]


class Route:
    def __init__(self, folder, *options: str, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        keys = ["--api-key", api_key] if api_key else []
        self.launch(["--model", str(folder), *REPLICA_OPTIONS, *keys, *options], api_key, env)

    def launch(self, options: list[str], api_key: str | None = None,
               env: dict[str, str] | None = None) -> None:
        """`ember route OPTIONS` on a free port. Its output goes to a file: a pipe that nobody
        reads blocks the gateway once it fills (a few dozen log lines)."""
        self.argv = (options, api_key, env)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ember-route-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "route", "--port", str(self.port), *options],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        """What the gateway has logged so far."""
        return Path(self.log.name).read_text(errors="replace")

    def fleet(self) -> dict:
        return httpx.get(self.url + "/fleet", headers=self.headers, timeout=30).json()

    def wait(self, predicate, what: str, timeout_s: float = 180) -> dict:
        """/fleet once `predicate` holds of it; the gateway must stay up meanwhile."""
        def fleet_if_holds() -> dict | None:
            if self.proc.poll() is not None and PORT_TAKEN in self.output().lower():
                self.launch(*self.argv)     # its free port was taken before it bound it
            assert self.proc.poll() is None, self.output()[-8000:]
            try:
                fleet = self.fleet()
            except httpx.TransportError:
                return None
            return fleet if predicate(fleet) else None
        return wait_for(fleet_if_holds, what, timeout_s, every_s=0.2)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ready_count(fleet: dict) -> int:
    return sum(r["state"] == "ready" for r in fleet["replicas"])


@pytest.fixture(scope="module")
def route(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = Route(folder, "--replicas", "2", "--policy", "least-load")
    live.wait(lambda f: ready_count(f) == 2, "two replicas ready")
    yield live
    live.close()


def one_request(url: str, i: int, max_tokens: int = 160,
                on_start: Callable[[], None] | None = None) -> dict:
    """A long request; for a stream, whether bytes came before it ended, and how.
    `on_start`: called once, at a stream's first token."""
    body = {"prompt": f"Request {i} asks:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": i % 2 == 0}
    out = {"stream": body["stream"], "started": False, "status": None, "error": None}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        out["error"] = payload["error"]
                    else:
                        if not out["started"] and on_start is not None:
                            on_start()
                        out["started"] = True
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    return out


def test_sigkill_under_load_loses_no_request_that_had_not_streamed(route):
    victim = route.fleet()["replicas"][0]
    streaming = threading.Semaphore(0)
    with ThreadPoolExecutor(12) as pool:
        # 400 tokens each: the kill comes as the 4th stream starts, long before any ends
        # (a poll of /fleet could miss requests that short on a fast machine)
        futures = [pool.submit(one_request, route.url, i, 400, streaming.release)
                   for i in range(12)]
        for _ in range(4):
            assert streaming.acquire(timeout=120), "the streams never started"
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result() for f in futures]
    lost = [r for r in results if (r["status"] != 200 or r["error"]) and not r["started"]]
    assert lost == []
    # a stream may fail only after its first bytes, and then with an error event
    for r in results:
        if r["error"]:
            assert r["stream"] and r["started"] and r["error"]["code"] == 502
    assert route.metric("ember_router_retries_total") + \
        sum(r["error"] is not None for r in results) >= 1  # the kill did hit requests
    fleet = route.wait(lambda f: any(r["restarts"] >= 1 and r["state"] == "ready"
                                     for r in f["replicas"]), "restarted")
    restarted = next(r for r in fleet["replicas"] if r["id"] == victim["id"])
    assert restarted["pid"] != victim["pid"]
    assert route.metric("ember_router_replica_restarts_total") >= 1


def test_scale_from_zero_answers_every_request_and_scales_back(tiny_llama_dir, route):
    route.close()  # at most two replicas at once
    folder, _ = tiny_llama_dir
    cold = Route(folder, "--replicas", "0", "--min-replicas", "0", "--max-replicas", "1",
                 "--scale-to-zero-after", "2")
    try:
        cold.wait(lambda f: True, "up", 60)
        assert httpx.get(cold.url + "/health/ready").status_code == 200  # can start one
        assert cold.fleet()["replicas"] == []
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda i: httpx.post(cold.url + "/v1/completions", json={
                "prompt": f"cold {i}", "max_tokens": 4}, timeout=180), range(3)))
        assert [a.status_code for a in answers] == [200, 200, 200]
        started = cold.fleet()["replicas"][0]["cold_start"]
        assert {"process", "files", "kernels", "weights", "kv_cache", "warm_up"} <= \
            set(started["phases"])
        assert started["first_byte_s"] >= started["ready_s"] > 0  # held until it was ready
        assert cold.metric('ember_router_scale_events_total{direction="up"}') == 1
        assert cold.metric("ember_router_cold_start_seconds_count") == 1
        cold.wait(lambda f: f["replicas"] == [], "scaled to zero", 60)
        assert cold.metric('ember_router_scale_events_total{direction="down"}') == 1
        again = httpx.post(cold.url + "/v1/completions", json={"prompt": "warm?",
                                                               "max_tokens": 4}, timeout=180)
        assert again.status_code == 200
        assert cold.metric('ember_router_scale_events_total{direction="up"}') == 2
        # SIGTERM drains: the gateway stops its replica and exits 0, as `ember serve` does
        replica_pid = cold.fleet()["replicas"][0]["pid"]
        cold.proc.send_signal(signal.SIGTERM)
        assert cold.proc.wait(60) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(replica_pid, 0)
    finally:
        cold.close()


def greedy_text(url: str) -> str:
    body = {"prompt": "The tensor-parallel replica says", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


@pytest.mark.slow
def test_a_replica_of_two_ranks_answers_as_one_of_one(tiny_llama_dir):
    """A route's one replica at T=2, its ranks bound to cores of their own, gives the greedy
    text of a T=1 replica."""
    folder, _ = tiny_llama_dir
    texts = []
    for options in ((), ("--tensor-parallel-size", "2")):
        live = Route(folder, "--replicas", "1", "--quantization", "none", *options)
        try:
            fleet = live.wait(lambda f: ready_count(f) == 1, "one replica ready")
            texts.append(greedy_text(live.url))
            if options:   # a core per rank, and rank 0 (the replica's process) on the first
                pid = fleet["replicas"][0]["pid"]
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                cores = sorted(os.sched_getaffinity(0))
                half = len(cores) // 2
                first, second = cores[:half], cores[half:2 * half]
                assert argv[argv.index(b"--cpu-bind") + 1].decode() == \
                    f"{','.join(map(str, first))}|{','.join(map(str, second))}"
                assert os.sched_getaffinity(pid) == set(first)
        finally:
            live.close()
    assert texts[0] == texts[1]
