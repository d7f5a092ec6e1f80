"""LoRA adapters and embeddings through the gateway. An adapter loaded at the gateway is
loaded on every replica, and on each replica that starts later; the reference is a replica
answering the same request itself."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from ember.router.replicas import RemoteHandle, Replica
from tests.router.conftest import LiveGateway
from tests.server.conftest import LiveServer

pytest.importorskip("peft")
TINY = {"max_model_len": 512, "kernels": "torch"}


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.reference.test_lora import make_adapter
    _, base = tiny_llama_dir
    path = tmp_path_factory.mktemp("adapter_alpha")
    make_adapter(base, path, 8, 16, False, ["q_proj", "v_proj"], 0)
    return path


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
