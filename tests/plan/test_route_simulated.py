"""`ember route --replica-url` over simulated replicas: the gateway hashes prompts with the
model's tokenizer, reads the replicas' /kv/events, and routes a prompt to the replica that
holds its prefix, exactly as over real replicas (tests/router/test_gateway.py)."""
from __future__ import annotations

import time

import httpx
import pytest

from ember.server.protocol import CompletionRequest
from tests.plan.conftest import SimulatedServer
from tests.router.conftest import LiveGateway
from tests.router.test_route_processes import Route, ready_count
from tests.server.conftest import TEST_KV_GIB

SYSTEMS = ["You are a helpful assistant for a bakery. " * 8,
           "You are a terse assistant that answers questions about trains. " * 8]


@pytest.fixture(scope="module")
def fleet(profile, smollm_path):
    replicas = [SimulatedServer(profile) for _ in range(2)]
    gateway = LiveGateway({"r1": replicas[0].url, "r2": replicas[1].url},
                          model=str(smollm_path))
    gateway.wait_ready()
    yield gateway, replicas
    gateway.close()
    for r in replicas:
        r.close()


def decisions(gateway: LiveGateway, replica: str) -> float:
    return gateway.metric(f'ember_router_routing_decisions_total{{reason="prefix_hit",'
                          f'replica="{replica}"}}')


def served_by(gateway: LiveGateway, keys: list[int]) -> str:
    """Which replica reported the prompt's blocks (waiting for the gateway's poll)."""
    deadline = time.monotonic() + 20
    while True:
        for rid in ("r1", "r2"):
            if set(keys) <= gateway.fleet.blocks[rid].blocks:
                return rid
        assert time.monotonic() < deadline, "no replica reported the prompt's blocks"
        time.sleep(0.05)


def test_prompts_go_to_the_replica_that_holds_their_prefix(fleet):
    gateway, _ = fleet
    holders = []
    for system in SYSTEMS:
        prompt = system + "First question?"
        first = httpx.post(gateway.url + "/v1/completions",
                           json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert first.status_code == 200
        keys = gateway.gateway.prompts.route_keys(CompletionRequest(prompt=prompt), None,
                                                  {16}, {}, True).block_keys[16]
        holders.append(served_by(gateway, keys))
    for system, holder in zip(SYSTEMS, holders):
        before = decisions(gateway, holder)
        for i in range(3):   # (8 decisions in all: under the share guard's 8 of imbalance)
            r = httpx.post(gateway.url + "/v1/completions",
                           json={"prompt": system + f"Question {i}?", "max_tokens": 2},
                           timeout=60)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert decisions(gateway, holder) - before == 3


class SimulatedRoute(Route):
    """`ember route` as a process, its replicas `ember serve --simulate` processes."""

    def __init__(self, *options: str) -> None:
        self.launch(["-q", "--kv-cache-gib", str(TEST_KV_GIB), *options])


def test_route_starts_simulated_replicas_and_hashes_with_the_profiles_tokenizer(
        tmp_path, profile, smollm_tokenizer):
    """`ember route --replicas 3 --simulate PROFILE`: three local replicas with no weights,
    and a gateway that hashes prompts with the profile's tokenizer (no --model given), so a
    prefix sticks to the replica that holds it."""
    path = tmp_path / "profile.json"
    profile.save(path)
    route = SimulatedRoute("--replicas", "3", "--simulate", str(path))
    hit = 'ember_router_routing_decisions_total{reason="prefix_hit"'
    try:
        route.wait(lambda f: ready_count(f) == 3, "three replicas ready", 120)
        prompt = SYSTEMS[0] + "A question?"
        first = httpx.post(route.url + "/v1/completions",
                           json={"prompt": prompt, "max_tokens": 2}, timeout=60).json()
        assert first["usage"]["prompt_tokens"] == len(smollm_tokenizer.encode(prompt))
        deadline = time.monotonic() + 30
        while route.metric(hit) == 0:   # the gateway knows the prefix now (routed or polled)
            assert time.monotonic() < deadline, "no request found the prefix"
            httpx.post(route.url + "/v1/completions",
                       json={"prompt": SYSTEMS[0] + "Again?", "max_tokens": 2}, timeout=60)
        before = route.metric(hit)
        answers = [httpx.post(route.url + "/v1/completions", json={
            "prompt": SYSTEMS[0] + f"Question {i}?", "max_tokens": 2}, timeout=60).json()
            for i in range(3)]
        assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64 for a in answers)
        assert route.metric(hit) - before == 3
    finally:
        route.close()
