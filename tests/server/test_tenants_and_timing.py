"""Latency metrics timed from a request's arrival, tokenizing off the event loop, and tenants
(an API keys file) through HTTP.

References: delays injected into the tokenizer and the engine's steps are lower bounds on the
latencies the metrics must report (never upper bounds: nothing here asserts how fast); the
prefix-cache rule of test_prefix_cache.py (a repeat reuses all but its last prompt token);
OpenAI's error envelope.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ember.config import ApiKey
from ember.kv.prefix_cache import extend_keys
from tests.server.conftest import LiveServer

KEYS = (ApiKey("key-a", "alice"), ApiKey("key-b", "bob", best_priority=0))
AUTH = {"Authorization": "Bearer key-a"}
LONG = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def live(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    server = LiveServer(folder, engine_options={"max_model_len": 512}, api_keys=KEYS)
    yield server
    server.close()


def post(live: LiveServer, path: str, key: str | None = "key-a", timeout: float = 60,
         **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(live.url + path, json=body, headers=headers, timeout=timeout)


def complete(live: LiveServer, key: str = "key-a", **body) -> dict:
    r = post(live, "/v1/completions", key, **{"max_tokens": 2, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sample(live: LiveServer, name: str, **labels: str) -> float:
    """One series of /metrics: `name` with exactly these labels."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in httpx.get(live.url + "/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric == name and set(filter(None, label_text.rstrip("}").split(","))) == want:
            return float(value)
    raise AssertionError(f"no series {name}{labels} in /metrics")


# -- latencies ---------------------------------------------------------------------------------

def test_ttft_and_e2e_include_tokenizing(live, monkeypatch):
    """A tokenizer that takes DELAY_S: the request's TTFT and E2E both hold that time."""
    delay_s = 0.3
    tokenizer = live.engine.tokenizer
    real_encode = tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(delay_s)
        return real_encode(text, add_special_tokens)
    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    names = ("ember_time_to_first_token_seconds", "ember_e2e_request_latency_seconds")
    before = {(n, s): sample(live, n + s, tenant="alice") for n in names for s in ("_sum",
                                                                                 "_count")}
    complete(live, prompt="hello there", max_tokens=3, ignore_eos=True)
    for name in names:
        assert sample(live, name + "_count", tenant="alice") == before[name, "_count"] + 1
        assert sample(live, name + "_sum", tenant="alice") - before[name, "_sum"] >= delay_s


def test_tpot_and_itl_are_per_choice(live, monkeypatch):
    """n=2, 6 tokens each, every engine step held STEP_S: each choice's tokens are at least a
    step apart, so each choice's TPOT is >= STEP_S (dividing by both choices' 12 tokens would
    give about half), and each choice's gaps add up to >= 5 steps."""
    step_s, num_tokens = 0.1, 6
    real_step = live.engine.core.step

    def slow_step(only=None):
        time.sleep(step_s)
        return real_step(only)
    monkeypatch.setattr(live.engine.core, "step", slow_step)
    tpot, itl = "ember_time_per_output_token_seconds", "ember_inter_token_latency_seconds"
    before = {m: sample(live, m, tenant="alice") for m in
              (tpot + "_sum", tpot + "_count", itl + "_sum")}
    body = complete(live, prompt="two choices", n=2, max_tokens=num_tokens, ignore_eos=True,
                    seed=7)
    assert body["usage"]["completion_tokens"] == 2 * num_tokens
    assert sample(live, tpot + "_count", tenant="alice") == before[tpot + "_count"] + 2
    assert sample(live, tpot + "_sum", tenant="alice") - before[tpot + "_sum"] >= 2 * step_s
    gaps = sample(live, itl + "_sum", tenant="alice") - before[itl + "_sum"]
    assert gaps >= 2 * (num_tokens - 1) * step_s


def test_a_huge_prompt_is_tokenized_off_the_event_loop(live, monkeypatch):
    """While a multi-megabyte chat prompt is being tokenized (held there by the test), another
    request streams to its end; only then is the big one let go."""
    tokenizer = live.engine.tokenizer
    real_encode = tokenizer.encode
    in_encode, release = threading.Event(), threading.Event()
    order: list[str] = []

    def held_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 1_000_000:
            in_encode.set()
            release.wait(20)
            order.append("big prompt tokenized")
        return real_encode(text, add_special_tokens)
    monkeypatch.setattr(tokenizer, "encode", held_encode)
    big: list[httpx.Response] = []
    huge = "All work and no play makes Jack a dull boy. " * 50_000  # 2.2 MB
    thread = threading.Thread(target=lambda: big.append(post(
        live, "/v1/chat/completions", messages=[{"role": "user", "content": huge}],
        max_tokens=2)))
    thread.start()
    try:
        assert in_encode.wait(30), "the big request never reached its tokenizer"
        events = []
        with httpx.stream("POST", live.url + "/v1/completions", timeout=10,
                          headers={"Authorization": "Bearer key-b"},
                          json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        order.append("small stream done")
        assert events[-1] == "data: [DONE]" and len(events) >= 2
    finally:
        release.set()
        thread.join(60)
    assert order == ["small stream done", "big prompt tokenized"]
    assert big[0].status_code == 400 and "shorten the prompt" in big[0].text


def test_the_tokenizer_lets_other_threads_run_while_it_encodes(live):
    """The worker thread only helps if the tokenizer lets go of the GIL: while it encodes a
    2 MB prompt, this thread takes the GIL back 200 times (a tokenizer that held it would
    leave this thread stopped until the encoding ended)."""
    huge = "All work and no play makes Jack a dull boy. " * 50_000
    started = threading.Event()

    def encode() -> None:
        started.set()
        live.engine.tokenizer.encode(huge)
    thread = threading.Thread(target=encode)
    thread.start()
    started.wait()
    for _ in range(200):
        time.sleep(0)  # gives up the GIL and waits to take it back
    still_encoding = thread.is_alive()
    thread.join()
    assert still_encoding


# -- tenants -----------------------------------------------------------------------------------

def test_tenants_never_see_each_others_cached_prefixes(live):
    prompt = LONG + "tenants"
    first = complete(live, "key-a", prompt=prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    other = complete(live, "key-b", prompt=prompt)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(live, "key-a", prompt=prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        first["usage"]["prompt_tokens"] - 1
    # the same request salt does not join two tenants either
    complete(live, "key-a", prompt=prompt + " salted", cache_salt="shared")
    salted = complete(live, "key-b", prompt=prompt + " salted", cache_salt="shared")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_kv_events_cannot_be_probed_by_tenant_name(live):
    """The tenant names are public (/metrics shows them); the salt of a tenant's prefixes is
    not, so the block hashes /kv/events publishes match nothing anyone can compute from a
    tenant's name and a guessed prompt (with or without a request salt)."""
    start = httpx.get(live.url + "/kv/events", headers=AUTH).json()
    last = max([e["seq"] for e in start["events"]], default=-1)
    prompt = "Probe: " + LONG.replace("dog", "owl")
    complete(live, "key-a", prompt=prompt, max_tokens=1)
    complete(live, "key-a", prompt=prompt, max_tokens=1, cache_salt="s")
    ids = post(live, "/tokenize", prompt=prompt).json()["tokens"]
    page = httpx.get(live.url + "/kv/events", params={"after": last}, headers=AUTH).json()
    stored = {e["block_hash"] for e in page["events"] if e["type"] == "stored"}
    assert len(stored) >= 2 * (len(ids) // 16)  # both requests' blocks were published
    for salt in (None, "alice", "alice\ns", "s"):
        assert not stored & set(extend_keys([], ids, 16, salt)), salt


def test_priority_above_the_keys_allowance_is_403(live):
    r = post(live, "/v1/completions", "key-b", prompt="x", max_tokens=1, priority=-1)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["type"] == "permission_error" and error["param"] == "priority"
    assert error["code"] == 403 and "priority >= 0" in error["message"]
    chat = post(live, "/v1/chat/completions", "key-b", max_tokens=1, priority=-5,
                messages=[{"role": "user", "content": "x"}])
    assert chat.status_code == 403 and "priority >= 0" in chat.json()["error"]["message"]
    for key, body in [("key-b", {"priority": 0}), ("key-b", {"priority": 3}), ("key-b", {}),
                      ("key-a", {"priority": -5})]:
        assert post(live, "/v1/completions", key, prompt="x", max_tokens=1,
                    **body).status_code == 200, (key, body)


def test_wrong_or_missing_key_is_401(live):
    for key in ("key-c", None, "key-a-but-longer", "KEY-A"):
        r = post(live, "/v1/completions", key, prompt="x", max_tokens=1)
        assert r.status_code == 401, key
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(live.url + "/metrics").status_code == 200


def test_request_metrics_carry_the_tenant(live):
    def done(tenant: str) -> float:
        return sample(live, "ember_request_success_total", finish_reason="length", tenant=tenant)
    before = {t: done(t) for t in ("alice", "bob")}
    complete(live, "key-b", prompt="counted for bob", max_tokens=2, ignore_eos=True)
    assert done("bob") == before["bob"] + 1
    assert done("alice") == before["alice"]
    assert sample(live, "ember_generation_tokens_total", tenant="bob") >= 2
    text = httpx.get(live.url + "/metrics").text
    tenants = {part.split('"')[1] for line in text.splitlines() if not line.startswith("#")
               for part in line.split(",") + line.split("{") if part.startswith('tenant="')}
    assert tenants == {"alice", "bob"}


def test_streamed_usage_reports_the_tenants_cache(live):
    chat = {"messages": [{"role": "user", "content": LONG + "chat"}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    usages = []
    for key in ("key-a", "key-b", "key-a"):
        text = post(live, "/v1/chat/completions", key, **chat).text
        usages.append(json.loads(text.split("data: ")[-2])["usage"])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == \
        [0, 0, usages[2]["prompt_tokens"] - 1]
