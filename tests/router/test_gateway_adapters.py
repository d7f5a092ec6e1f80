"""LoRA adapters and embeddings through the gateway. An adapter loaded at the gateway is
loaded on every replica, and on each replica that starts later; the reference is a replica
answering the same request itself, and for routing keys the block hashes a replica reports in
/kv/events."""
from __future__ import annotations

import time

import httpx
import pytest

from ember.router.replicas import RemoteHandle, Replica
from ember.server.protocol import CompletionRequest, EmbeddingRequest
from tests.router.conftest import LiveGateway
from tests.server.conftest import LiveServer

pytest.importorskip("peft")
TINY = {"max_model_len": 512, "kernels": "torch"}
LONG = "A fleet of replicas keeps the prompt blocks of every tenant that it serves. " * 8


def models(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(url + "/v1/models").json()["data"]]


def test_adapters_reach_every_replica_and_later_ones(tiny_llama_dir, adapter):
    folder, _ = tiny_llama_dir
    first, later = (LiveServer(folder, engine_options=TINY) for _ in range(2))
    gw = LiveGateway({"r1": first.url})
    try:
        gw.wait_ready()
        loaded = httpx.post(gw.url + "/v1/load_lora_adapter", json={
            "lora_name": "alpha", "lora_path": str(adapter)}, timeout=60)
        assert loaded.status_code == 200 and loaded.json()["replicas"] == ["r1"]
        ask = {"model": "alpha", "prompt": "Tell me", "max_tokens": 6, "temperature": 0,
               "ignore_eos": True}
        routed = httpx.post(gw.url + "/v1/completions", json=ask, timeout=60)
        direct = httpx.post(first.url + "/v1/completions", json=ask, timeout=60)
        assert routed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]

        gw.fleet.add(Replica("r2", RemoteHandle(later.url)))   # starts after the load
        gw.wait_ready(2)
        assert "alpha" in models(later.url)                     # replayed before ready

        bad = httpx.post(gw.url + "/v1/load_lora_adapter", json={
            "lora_name": "broken", "lora_path": "/no/such/adapter"}, timeout=60)
        want = httpx.post(first.url + "/v1/load_lora_adapter", json={
            "lora_name": "broken", "lora_path": "/no/such/adapter"}, timeout=60)
        assert (bad.status_code, bad.json()) == (want.status_code, want.json())
        assert set(gw.fleet.adapters) == {"alpha"}

        unloaded = httpx.post(gw.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        assert unloaded.status_code == 200
        assert "alpha" not in models(first.url) and "alpha" not in models(later.url)
        assert gw.fleet.adapters == {}
    finally:
        gw.close()
        first.close()
        later.close()


def test_embeddings_through_the_gateway_are_the_replicas(replicas):
    gw = LiveGateway({"r1": replicas[0].url})
    try:
        gw.wait_ready()
        ask = {"input": ["a fleet of replicas", "one server"]}
        routed = httpx.post(gw.url + "/v1/embeddings", json=ask, timeout=60)
        direct = httpx.post(replicas[0].url + "/v1/embeddings", json=ask, timeout=60)
        assert routed.status_code == 200
        assert [d["embedding"] for d in routed.json()["data"]] == \
            [d["embedding"] for d in direct.json()["data"]]
        bad = httpx.post(gw.url + "/v1/embeddings", json={"input": []})
        assert bad.status_code == 400          # the replica's own validation, not retried
        assert gw.metric("ember_router_retries_total") == 0
        deadline = time.monotonic() + 5
        while gw.fleet.replicas["r1"].in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        gw.close()


def cards(url: str) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}


def keys_of(gw: LiveGateway, body, adapter: str | None = None) -> list[int]:
    """The block keys (of 16 tokens) the gateway gives a request."""
    return gw.gateway.prompts.route_keys(body, None, {16}, {}, True, adapter=adapter
                                         ).block_keys[16]


def holder_of(gw: LiveGateway, keys: list[int]) -> str:
    """The replica whose own /kv/events report every one of `keys`."""
    assert len(keys) >= 4
    deadline = time.monotonic() + 20
    while True:
        for rid, index in list(gw.fleet.blocks.items()):
            if set(keys) <= index.blocks:
                return rid
        assert time.monotonic() < deadline, "no replica reported the gateway's keys"
        time.sleep(0.05)


def decisions(gw: LiveGateway, reason: str, replica: str | None = None) -> float:
    labels = f'reason="{reason}",' + (f'replica="{replica}"' if replica else "")
    return gw.metric(f"ember_router_routing_decisions_total{{{labels}")


def test_last_pooled_embeddings_route_by_their_prefix(replicas, tiny_llama_dir):
    """A decoder pools by the last token and keeps the prompt's blocks: the gateway hashes an
    embedding's first input as the replica does, and one with the same prefix follows it."""
    folder, _ = tiny_llama_dir
    gw = LiveGateway({"r1": replicas[0].url, "r2": replicas[1].url}, model=str(folder))
    try:
        gw.wait_ready()
        assert {c["pooling"] for c in cards(replicas[0].url).values()} == {"last"}
        assert gw.fleet.caches_embeddings()
        first = httpx.post(gw.url + "/v1/embeddings", json={"input": LONG + "first"},
                           timeout=60)
        assert first.status_code == 200
        holder = holder_of(gw, keys_of(gw, EmbeddingRequest(input=LONG + "first")))
        before = decisions(gw, "prefix_hit", holder)
        for ask in (LONG + "second", [LONG + "third", "another input"]):
            assert httpx.post(gw.url + "/v1/embeddings", json={"input": ask},
                              timeout=60).status_code == 200
        assert decisions(gw, "prefix_hit", holder) - before == 2
    finally:
        gw.close()


def test_mean_pooled_embeddings_route_by_load(tiny_llama_dir):
    """Mean pooling reads every row, so the replica caches none: nothing to route to."""
    folder, _ = tiny_llama_dir
    mean = LiveServer(folder, engine_options=TINY | {"pooling": "mean"})
    gw = LiveGateway({"r1": mean.url}, model=str(folder))
    try:
        gw.wait_ready()
        assert cards(mean.url)[mean.state.model_name]["pooling"] == "mean"
        assert not gw.fleet.caches_embeddings()
        for ask in (LONG + "first", LONG + "second"):
            assert httpx.post(gw.url + "/v1/embeddings", json={"input": ask},
                              timeout=60).status_code == 200
        assert decisions(gw, "prefix_miss") == 2 and decisions(gw, "prefix_hit") == 0
    finally:
        gw.close()
        mean.close()


def test_adapter_prompts_route_by_the_replicas_salted_keys(replicas, tiny_llama_dir, adapter):
    """A replica salts an adapter's blocks by the digest of its files, which its /v1/models
    reports; the gateway salts its keys alike, so they are the replica's own block hashes and
    the adapter's later prompts with the same prefix go where it is cached."""
    folder, _ = tiny_llama_dir
    gw = LiveGateway({"r1": replicas[0].url, "r2": replicas[1].url}, model=str(folder))
    try:
        gw.wait_ready()
        loaded = httpx.post(gw.url + "/v1/load_lora_adapter", json={
            "lora_name": "alpha", "lora_path": str(adapter)}, timeout=60)
        assert loaded.status_code == 200
        digest = gw.fleet.adapter_digest("alpha")
        assert digest == cards(replicas[0].url)["alpha"]["digest"] == \
            cards(replicas[1].url)["alpha"]["digest"]
        listed = cards(gw.url)
        assert [(c["id"], c["parent"], c.get("digest")) for c in listed.values()] == \
            [(c["id"], c["parent"], c.get("digest")) for c in cards(replicas[0].url).values()]
        assert listed["alpha"]["parent"] == replicas[0].state.model_name

        def ask(i: int) -> dict:
            return {"model": "alpha", "prompt": LONG + f"Question {i}?", "max_tokens": 2,
                    "temperature": 0}
        assert httpx.post(gw.url + "/v1/completions", json=ask(0), timeout=60).status_code == 200
        keys = keys_of(gw, CompletionRequest(**ask(0)), digest)
        assert not set(keys) & set(keys_of(gw, CompletionRequest(**ask(0))))  # not the base's
        holder = holder_of(gw, keys)
        before = decisions(gw, "prefix_hit", holder)
        for i in range(1, 4):
            assert httpx.post(gw.url + "/v1/completions", json=ask(i),
                              timeout=60).status_code == 200
        assert decisions(gw, "prefix_hit", holder) - before == 3
        assert httpx.post(gw.url + "/v1/unload_lora_adapter",
                          json={"lora_name": "alpha"}).status_code == 200
        assert "alpha" not in cards(gw.url) and gw.fleet.adapter_digest("alpha") is None
    finally:
        gw.close()
