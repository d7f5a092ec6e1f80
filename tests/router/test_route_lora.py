"""`ember route --replicas 2 --api-key K --lora a=PATH` as a process over real `ember serve`
replica processes (the tiny model): the base model, the adapter and embeddings through the
gateway, with the key and never without it, and a second chat sharing a long prefix served
from the cache. The reference is a replica answering the same request itself."""
from __future__ import annotations

import httpx
import pytest

from tests.router.test_route_processes import Route, ready_count

KEY = "sk-fleet-key"
SYSTEM = "You are the assistant of a fleet of replicas. Answer briefly and politely. " * 6


@pytest.fixture(scope="module")
def route(tiny_llama_dir, adapter):
    folder, _ = tiny_llama_dir
    live = Route(folder, "--replicas", "2", "--lora", f"a={adapter}", api_key=KEY)
    live.wait(lambda f: ready_count(f) == 2, "two replicas ready")
    yield live
    live.close()


def chat(url: str, model: str, question: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120, json={"model": model, "max_tokens": 8, "temperature": 0,
                                      "messages": [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_without_the_key_are_refused(route):
    asks = [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("POST", "/v1/embeddings", {"input": "hi"}), ("GET", "/v1/models", None),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/x"}),
            ("GET", "/fleet", None)]
    for method, path, body in asks:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            r = httpx.request(method, route.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, r.text)


def test_base_adapter_and_embeddings_answer_as_a_replica_and_reuse_the_prefix(route):
    auth = route.headers
    replica = route.fleet()["replicas"][0]["url"]
    cards = httpx.get(route.url + "/v1/models", headers=auth).json()["data"]
    base = cards[0]["id"]
    assert [(c["id"], c["parent"]) for c in cards] == [(base, None), ("a", base)]
    direct_cards = httpx.get(replica + "/v1/models", headers=auth).json()["data"]
    assert cards[1]["digest"].startswith("sha256:")
    assert [c.get("digest") for c in cards] == [c.get("digest") for c in direct_cards]

    texts = {}
    for model in (base, "a"):
        answer = chat(route.url, model, "Question one?")
        texts[model] = answer["choices"][0]["message"]["content"]
        assert texts[model] == chat(replica, model, "Question one?")["choices"][0][
            "message"]["content"]
    assert texts[base] != texts["a"]            # the adapter changes the answer

    ask = {"input": ["a fleet of replicas", "one server"]}
    routed = httpx.post(route.url + "/v1/embeddings", json=ask, headers=auth, timeout=60)
    direct = httpx.post(replica + "/v1/embeddings", json=ask, headers=auth, timeout=60)
    assert routed.status_code == 200
    assert [d["embedding"] for d in routed.json()["data"]] == \
        [d["embedding"] for d in direct.json()["data"]]

    hits = 'ember_router_routing_decisions_total{reason="prefix_hit"'
    before = route.metric(hits)
    for model in (base, "a"):       # the system prompt's blocks, from the first chat's replica
        usage = chat(route.url, model, "Question two?")["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 64, (model, usage)
    assert route.metric(hits) - before == 2
