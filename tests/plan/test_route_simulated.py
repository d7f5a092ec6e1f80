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
