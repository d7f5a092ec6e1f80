"""The prefix cache, salts, priorities and KV events through the HTTP API.

Reference: the cache rules (16-token blocks, never the last prompt token, a finished request's
partly filled last block kept) and the chained keys of ember/kv/prefix_cache.py computed here
from the server's own /tokenize.
"""
from __future__ import annotations

import json
import threading
import time

import httpx

from ember.kv.prefix_cache import extend_keys
from tests.server.conftest import LiveServer

LONG = "The quick brown fox jumps over the lazy dog. " * 12


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def expected_hit(num_prompt_tokens: int) -> int:
    """A repeat of a prompt longer than a block: the first request's blocks are cached, its
    partly filled last one too once it finished, so the repeat reuses all but its last token
    (recomputed for logits)."""
    return num_prompt_tokens - 1


def test_cached_tokens_are_reported_like_openai(server):
    first = complete(server, prompt=LONG + "one")
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = complete(server, prompt=LONG + "one")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(n)
    chat = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    body = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).text
    usage = json.loads(body.split("data: ")[-2])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected_hit(usage["prompt_tokens"])


def test_greedy_text_is_the_same_with_and_without_a_hit(server):
    cold = complete(server, prompt=LONG + "two", max_tokens=12, temperature=0,
                    prefix_cache=False)
    warm1 = complete(server, prompt=LONG + "two", max_tokens=12, temperature=0)
    warm2 = complete(server, prompt=LONG + "two", max_tokens=12, temperature=0)
    assert warm2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold["choices"][0]["text"] == warm1["choices"][0]["text"] == \
        warm2["choices"][0]["text"]


def test_salts_isolate_tenants_and_opting_out_stores_nothing(server):
    prompt = LONG + "three"
    complete(server, prompt=prompt)
    salted = complete(server, prompt=prompt, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(server, prompt=prompt, cache_salt="tenant-a")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = complete(server, prompt=prompt, cache_salt="tenant-b")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    private = LONG.replace("fox", "cat") + "four"
    complete(server, prompt=private, prefix_cache=False)
    after = complete(server, prompt=private)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_prefix_cache_metrics(server):
    hits = server.metric('ember_prefix_cache_hits_total{model_name="%s"}'
                         % server.state.model_name)
    cached = sum(complete(server, prompt=LONG + "five")["usage"]["prompt_tokens_details"]
                 ["cached_tokens"] for _ in range(2))
    name = server.state.model_name
    assert server.metric(f'ember_prefix_cache_hits_total{{model_name="{name}"}}') == \
        hits + cached
    assert server.metric(f'vllm:prefix_cache_hits_total{{model_name="{name}"}}') == \
        hits + cached
    assert server.metric(f'ember_prefix_cache_blocks{{model_name="{name}"}}') > 0


def test_kv_events_name_the_blocks_a_prompt_stored(server):
    start = httpx.get(server.url + "/kv/events").json()
    last = max([e["seq"] for e in start["events"]], default=-1)
    prompt = "Events: " + LONG.replace("dog", "hen")
    complete(server, prompt=prompt, max_tokens=1)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    keys = extend_keys([], ids, 16)
    page = httpx.get(server.url + "/kv/events", params={"after": last}).json()
    stored = [e for e in page["events"] if e["type"] == "stored"]
    *stored, tail = stored                    # the partly filled last block, when it finished
    assert [e["block_hash"] for e in stored] == keys
    assert [e["num_tokens"] for e in stored] == [16] * len(keys)
    assert tail["parent_block_hash"] == keys[-1]
    assert tail["num_tokens"] == len(ids) - 16 * len(keys)  # max_tokens=1: the prompt's tail
    assert stored[1]["parent_block_hash"] == keys[0] and stored[0]["parent_block_hash"] is None
    assert page["block_size"] == 16 and page["dropped"] is False
    with httpx.stream("GET", server.url + "/kv/events/stream", params={"after": last},
                      timeout=10) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert json.loads(first[6:])["block_hash"] == keys[0]


def test_a_kv_snapshot_lists_every_cached_block_and_where_the_events_go_on(server):
    prompt = "Snapshot: " + LONG.replace("dog", "owl")
    complete(server, prompt=prompt, max_tokens=1)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    keys = extend_keys([], ids, 16)
    snap = httpx.get(server.url + "/kv/events", params={"snapshot": 1}).json()
    blocks = {b["block_hash"]: b for b in snap["snapshot"]}
    assert set(keys) <= set(blocks)
    assert [blocks[k]["parent_block_hash"] for k in keys] == [None, *keys[:-1]]
    assert {blocks[k]["num_tokens"] for k in keys} == {16}
    assert len(blocks) == server.scheduler.kv.pool.num_cached_blocks
    assert snap["block_size"] == 16 and snap["model"] == server.state.model_name
    newest = httpx.get(server.url + "/kv/events").json()["events"][-1]["seq"]
    assert snap["cursor"] == newest
    later = "Snapshot: " + LONG.replace("dog", "elk")
    complete(server, prompt=later, max_tokens=1)
    page = httpx.get(server.url + "/kv/events", params={"after": snap["cursor"]}).json()
    later_ids = httpx.post(server.url + "/tokenize", json={"prompt": later}).json()["tokens"]
    later_keys = extend_keys([], later_ids, 16)
    stored = {e["block_hash"] for e in page["events"] if e["type"] == "stored"}
    assert not page["dropped"] and set(later_keys) - set(keys) <= stored


def test_prefix_caching_can_be_turned_off(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"enable_prefix_caching": False})
    try:
        complete(live, prompt=LONG)
        assert complete(live, prompt=LONG)["usage"]["prompt_tokens_details"] == \
            {"cached_tokens": 0}
    finally:
        live.close()


def test_priority_preempts_over_http(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_num_seqs": 1})
    live.delay_steps(0.01)
    try:
        finished: list[str] = []

        def run(name: str, priority: int, max_tokens: int) -> None:
            complete(live, prompt=f"{name} request", max_tokens=max_tokens, ignore_eos=True,
                     priority=priority)
            finished.append(name)

        low = threading.Thread(target=run, args=("low", 5, 150))
        low.start()
        deadline = time.monotonic() + 60  # only stops a hung test
        while not live.scheduler.running:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        high = threading.Thread(target=run, args=("high", 0, 10))
        high.start()
        high.join(60)
        low.join(60)
        assert finished == ["high", "low"]
        assert live.metric('ember_num_preemptions_total{model_name="%s"}'
                           % live.state.model_name) >= 1
        r = httpx.post(live.url + "/v1/completions", timeout=60,
                       json={"prompt": "x", "max_tokens": 2, "priority": "high"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "priority" in error["message"]
    finally:
        live.close()


def test_a_chat_answer_splices_back_but_only_its_prompt_is_shared(server):
    """The model is made to answer with four single-space tokens, which re-encode as one
    four-space token; the next turn reuses the first turn's prompt KV to the token, and not
    the answer's: that KV is a decode row's, which the next turn's prompt rows would not
    compute (docs/architecture.md, "Same request, same answer")."""
    space = httpx.post(server.url + "/tokenize", json={"prompt": " ",
                                                       "add_special_tokens": False})
    [space_id] = space.json()["tokens"]
    turn1 = [{"role": "user", "content": LONG + "Say nothing."}]
    first = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": turn1, "max_tokens": 4, "logit_bias": {str(space_id): 100}}).json()
    answer = first["choices"][0]["message"]["content"]
    assert answer == "    " and first["usage"]["completion_tokens"] == 4
    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And now?"}]
    second = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": turn2, "max_tokens": 1}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == first["usage"]["prompt_tokens"]
