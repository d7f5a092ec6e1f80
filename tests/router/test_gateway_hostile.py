"""Hostile traffic through `ember route --replicas 2` (real processes, the tiny model): what a
replica survives (tests/server/test_validation.py, tests/server/test_fuzz.py, disconnects,
overload), the fleet survives too.

- every bad body gets the same 4xx through the gateway as from a replica (the reference);
- generated bodies never get a 5xx;
- clients that hang up mid-body, before the first byte and mid-stream leave no request
  running or waiting and every KV block free on every replica, and the gateway's own count of
  requests on each replica back at 0; a client that left mid-body is a quiet 499;
- a burst past the replicas' queues gets 429 with Retry-After (never 503), and the gateway
  stays ready;
- throughout, no replica is ejected or restarted, and no traceback is logged.
The replicas' queues are small (--max-num-seqs 4, --max-waiting 16) so that the burst
overflows them, and the gateway's --max-queue small so that holding a burst would show.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.router.test_route_processes import Route, ready_count
from tests.server.test_errors import assert_error
from tests.server.test_fuzz import DEFAULT_EXAMPLES, ENDPOINTS, FUZZ_EXAMPLES, run_property
from tests.server.test_validation import CHAT, COMPLETIONS, post
from tests.waiting import wait_for

MAX_NUM_SEQS, MAX_WAITING = 4, 16
LONG = 500   # tokens to generate: the context's room (512), so a request outlives any check
STORM = 8    # clients per kind of hang-up


@pytest.fixture(scope="module")
def route(tiny_llama_dir, tmp_path_factory):
    folder, _ = tiny_llama_dir
    logs = tmp_path_factory.mktemp("route")   # the replicas' logs land in $TMPDIR/ember-fleet-*
    live = Route(folder, "--replicas", "2", "--max-queue", "4", "--max-num-seqs",
                 str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING),
                 env={**os.environ, "TMPDIR": str(logs)})
    live.logs = logs
    live.wait(lambda f: ready_count(f) == 2, "two replicas ready", 600)
    live.pids = {r["id"]: r["pid"] for r in live.fleet()["replicas"]}
    yield live
    live.close()


class Direct:
    """A replica, for helpers that take a server with a `url`."""

    def __init__(self, url: str) -> None:
        self.url = url


def replica_urls(route: Route) -> list[str]:
    return [r["url"] for r in route.fleet()["replicas"]]


def gauges(url: str) -> dict[str, float]:
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:kv_cache_usage_perc")
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(names)}


def wait_all_free(route: Route, timeout_s: float = 180) -> None:
    """Until every replica runs nothing, queues nothing and has every KV block free, and the
    gateway counts no request on any of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        fleet = route.fleet()
        busy = {r["id"]: gauges(r["url"]) for r in fleet["replicas"]}
        busy = {rid: g for rid, g in busy.items() if any(g.values())}
        in_flight = {r["id"]: r["in_flight"] for r in fleet["replicas"] if r["in_flight"]}
        if not busy and not in_flight and fleet["held"] == 0:
            return
        assert time.monotonic() < deadline, f"not idle: replicas {busy}, gateway {in_flight}"
        time.sleep(0.2)



def assert_unharmed(route: Route) -> None:
    """Both replicas ready, none ejected or restarted (same processes), nothing logged as a
    failure by the gateway or a replica."""
    fleet = route.fleet()
    assert {r["id"]: (r["state"], r["restarts"], r["pid"]) for r in fleet["replicas"]} == \
        {rid: ("ready", 0, pid) for rid, pid in route.pids.items()}
    assert route.metric("ember_router_ejections_total") == 0
    assert route.metric("ember_router_replica_restarts_total") == 0
    logs = [route.output()] + [p.read_text(errors="replace")
                               for p in Path(route.logs).glob("ember-fleet-*/*.log")]
    for text in logs:
        for sign in ("Traceback", "internal error", "Exception in ASGI application"):
            assert sign not in text, text[-4000:]


BAD_BODIES = [("/v1/completions", *case) for case in COMPLETIONS] + \
    [("/v1/chat/completions", *case) for case in CHAT]


@pytest.mark.parametrize("path,body,words,param", BAD_BODIES,
                         ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, *_) in
                              enumerate(BAD_BODIES)])
def test_bad_bodies_get_the_replicas_own_400(route, path, body, words, param):
    direct = post(Direct(replica_urls(route)[0]), path, body)
    routed = post(route, path, body)
    assert_error(routed, 400, *words, param=param)
    assert routed.json() == direct.json()


@pytest.mark.heavy  # replicas fuzz the same bodies by default (tests/server/test_fuzz.py)
@pytest.mark.slow   # about a minute on 2 busy cores: over half of this module
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_generated_bodies_never_get_a_5xx(route, path):
    run_property(route, path, DEFAULT_EXAMPLES, derandomize=True)


@pytest.mark.fuzz
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_many_generated_bodies_never_get_a_5xx(route, path):
    run_property(route, path, FUZZ_EXAMPLES, derandomize=False)


def send(route: Route, body: dict, cut: int | None = None) -> socket.socket:
    """A POST /v1/completions on a socket of its own; with `cut`, only the body's first `cut`
    bytes are sent (its Content-Length says all of it)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", route.port), timeout=60)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload[:cut])
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before {marker!r}: {seen[-2000:]!r}"
        seen += chunk
    return seen


def long_body(i: int, stream: bool) -> dict:
    return {"prompt": f"Client {i} of the storm says:", "max_tokens": LONG,
            "ignore_eos": True, "stream": stream}


def answered(route: Route, replica: str, status: int) -> float:
    return route.metric(f'ember_router_requests_total{{replica="{replica}",'
                        f'status="{status}",')


def on_replicas(route: Route, status: int) -> float:
    return sum(answered(route, rid, status) for rid in route.pids)


def test_a_disconnect_storm_leaves_every_replica_idle_and_its_kv_free(route):
    wait_all_free(route)
    # mid-body: the gateway never has the whole body, so no replica sees the request
    before = answered(route, "none", 499)
    sockets = [send(route, long_body(i, False), cut=20) for i in range(STORM)]
    for sock in sockets:
        sock.close()
    wait_for(lambda: answered(route, "none", 499) - before == STORM, "mid-body 499s")
    # before the first byte: hung up once every request is on a replica
    before = on_replicas(route, 499)
    sockets = [send(route, long_body(i, False)) for i in range(STORM)]
    wait_for(lambda: sum(r["in_flight"] for r in route.fleet()["replicas"]) == STORM,
             "every request on a replica")
    for sock in sockets:
        sock.close()
    wait_for(lambda: on_replicas(route, 499) - before == STORM, "499s before the first byte")
    # mid-stream: hung up after the first chunk
    sockets = [send(route, long_body(i, True)) for i in range(STORM)]
    for sock in sockets:
        read_until(sock, b"data: {")
    for sock in sockets:
        sock.close()
    wait_all_free(route)
    assert_unharmed(route)


async def burst(route: Route, num_requests: int, capacity: int
                ) -> tuple[list[httpx.Response], int]:
    """`num_requests` long requests at once, held open until all but `capacity` of them are
    answered (the replicas hold at most `capacity`); then every client hangs up. The answers,
    and the gateway's /health/ready status meanwhile."""
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)
                                 ) as client:
        async def one(i: int) -> None:
            answers.append(await client.post(route.url + "/v1/completions",
                                             json=long_body(i, False)))
        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        deadline = time.monotonic() + 300
        while len(answers) < num_requests - capacity:
            assert time.monotonic() < deadline, f"{len(answers)} answered"
            await asyncio.sleep(0.05)
        ready = (await client.get(route.url + "/health/ready")).status_code
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return answers, ready


def answer_once_not_busy(route: Route, body: dict, timeout_s: float = 60) -> httpx.Response:
    """The answer to `body`, sent again while it gets 429 (the replicas' Retry-After has not
    run out yet)."""
    deadline = time.monotonic() + timeout_s
    while (r := httpx.post(route.url + "/v1/completions", json=body, timeout=120)
           ).status_code == 429:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    return r


def test_a_burst_past_the_queues_gets_429_and_the_fleet_stays_ready(route):
    wait_all_free(route)
    capacity = 2 * (MAX_NUM_SEQS + MAX_WAITING)
    answers, ready = asyncio.run(burst(route, 2 * capacity + 8, capacity))
    refused = [r for r in answers if r.status_code != 200]
    assert refused
    for r in refused:    # never 503: the gateway's hold queue (--max-queue 4) is not used
        assert_error(r, 429, "retry")
        assert int(r.headers["retry-after"]) >= 1
    # the replicas were full, not broken: the gateway stayed ready and keeps them
    assert ready == 200
    assert {r["state"] for r in route.fleet()["replicas"]} == {"ready"}
    wait_all_free(route)
    r = answer_once_not_busy(route, {"prompt": "After the burst", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert_unharmed(route)


def test_a_request_larger_than_any_queue_is_refused_alone(route):
    """More sequences (prompts x n) than a replica's queue takes: the replica's own 429,
    passed on as it is; the replicas are not taken for full, so the next request is served."""
    wait_for(lambda: not any(r["busy"] for r in route.fleet()["replicas"]),
             "the replicas' Retry-After after the burst")
    r = httpx.post(route.url + "/v1/completions", timeout=120, json={
        "prompt": ["a", "b", "c", "d", "e", "f"], "n": 3, "max_tokens": 2})
    assert_error(r, 429, f"takes at most {MAX_WAITING}", "adds 18")
    assert r.headers["retry-after"] and r.headers["x-ember-fault"] == "request"
    assert [r["busy"] for r in route.fleet()["replicas"]] == [False, False]
    r = httpx.post(route.url + "/v1/completions", timeout=120, json={
        "prompt": "Then a small one", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_after_all_of_it_no_replica_was_ejected_or_restarted(route):
    wait_all_free(route)
    assert_unharmed(route)
