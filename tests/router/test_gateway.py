"""The gateway in this process over two in-process tiny-model replicas. The reference is the
replica itself: what the gateway answers must be what a replica answers."""
from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest

from ember.config import ServerConfig
from ember.router.rollout import Rollout
from tests.router.conftest import LiveGateway
from tests.router.fakes import FakeReplica

SYSTEM = "You are the assistant of tenant number seven. Answer briefly and politely. " * 6


@pytest.fixture(scope="module")
def gateway(replicas, tiny_llama_dir):
    folder, _ = tiny_llama_dir
    gw = LiveGateway({"r1": replicas[0].url, "r2": replicas[1].url}, model=str(folder))
    gw.wait_ready()
    yield gw
    gw.close()


def client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kwargs)


def test_answers_and_streams_are_the_replicas_own(gateway, replicas):
    ask = dict(model=None, prompt="The capital of France is", max_tokens=12, temperature=0)
    direct = httpx.post(replicas[0].url + "/v1/completions", json=ask).json()
    routed = httpx.post(gateway.url + "/v1/completions", json=ask).json()
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed["usage"] == direct["usage"]
    ask_chat = dict(model=replicas[1].state.model_name, max_tokens=10, temperature=0,
                    messages=[{"role": "user", "content": "Say hi"}])
    want = client(replicas[1].url).chat.completions.create(**ask_chat).choices[0].message.content
    stream = client(gateway.url).chat.completions.create(**ask_chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    with httpx.stream("POST", gateway.url + "/v1/completions",
                      json=ask | {"stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) > 2


@pytest.mark.parametrize("body", [
    {"prompt": "x", "temperature": 5},
    {"prompt": "x", "bogus_field": 1},
    {"prompt": "x", "n": 99},
    {"messages": []},
    {"prompt": "x", "max_tokens": -1},
])
def test_bad_bodies_get_the_replicas_errors(gateway, replicas, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    want = httpx.post(replicas[0].url + path, json=body)
    got = httpx.post(gateway.url + path, json=body)
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    bad_json = httpx.post(gateway.url + path, content=b"{nope")
    assert bad_json.status_code == 400
    assert bad_json.json() == httpx.post(replicas[0].url + path, content=b"{nope").json()


def test_probes_fleet_and_metrics(gateway):
    assert httpx.get(gateway.url + "/health/live").status_code == 200
    assert httpx.get(gateway.url + "/health/ready").status_code == 200
    fleet = httpx.get(gateway.url + "/fleet").json()
    assert fleet["policy"] == "prefix"
    assert {r["id"] for r in fleet["replicas"]} == {"r1", "r2"}
    for r in fleet["replicas"]:
        assert {"id", "url", "pid", "state", "running", "waiting", "kv_usage"} <= set(r)
    text = httpx.get(gateway.url + "/metrics").text
    for name in ("ember_router_routing_decisions_total", "ember_router_replicas",
                 "ember_router_overhead_seconds", "ember_router_requests_total"):
        assert name in text


def test_gateway_keys_are_the_replicas_kv_event_keys_and_prefix_sticks(gateway):
    """The blocks the gateway computes for a prompt are those the replica that served it
    reports in /kv/events; later prompts with that prefix go to that replica."""
    first = httpx.post(gateway.url + "/v1/completions", json={
        "prompt": SYSTEM + "Question 0?", "max_tokens": 2, "temperature": 0}).json()
    assert "choices" in first
    fleet = gateway.fleet
    keys = gateway.gateway.prompts.route_keys(
        _body(SYSTEM + "Question 0?"), None, {16}, {}, True).block_keys[16]
    assert len(keys) >= 4
    deadline = time.monotonic() + 20
    while not any(set(keys) <= fleet.blocks[r].blocks for r in ("r1", "r2")):
        assert time.monotonic() < deadline, "no replica reported the prompt's blocks"
        time.sleep(0.05)
    holder = next(r for r in ("r1", "r2") if set(keys) <= fleet.blocks[r].blocks)
    before = gateway.metric(f'ember_router_routing_decisions_total{{reason="prefix_hit",'
                            f'replica="{holder}"}}')
    for i in range(1, 6):
        httpx.post(gateway.url + "/v1/completions", json={
            "prompt": SYSTEM + f"Question {i}?", "max_tokens": 2, "temperature": 0})
    after = gateway.metric(f'ember_router_routing_decisions_total{{reason="prefix_hit",'
                           f'replica="{holder}"}}')
    assert after - before == 5


def _body(prompt: str):
    from ember.server.protocol import CompletionRequest
    return CompletionRequest(prompt=prompt)


def test_a_failing_replica_is_retried_around_and_ejected(replicas):
    broken = FakeReplica("status_500")
    gw = LiveGateway({"r0": broken.url, "r1": replicas[0].url}, policy="round-robin",
                     eject_s=60)
    try:
        gw.wait_ready()
        statuses = [httpx.post(gw.url + "/v1/completions", json={
            "prompt": f"hello {i}", "max_tokens": 2}).status_code for i in range(6)]
        assert statuses == [200] * 6
        assert broken.hits == 1  # no new request went to it after its first failure
        assert gw.metric('ember_router_retries_total{reason="status_500"}') == 1
        assert gw.metric('ember_router_ejections_total{reason="status_500",replica="r0"}') == 1
    finally:
        gw.close()
        broken.close()


def test_full_replicas_are_skipped_not_ejected_and_the_client_gets_429():
    """Every replica answers 429 (its queue is full): the request is tried on each, then
    refused with 429 and Retry-After, not held (a small hold queue would answer 503); the
    replicas stay ready and take requests again once they have room."""
    full = [FakeReplica("full"), FakeReplica("full")]
    gw = LiveGateway({"r1": full[0].url, "r2": full[1].url}, max_queue=1, eject_s=60)
    try:
        gw.wait_ready()
        answers = [httpx.post(gw.url + "/v1/completions", json={"prompt": f"hi {i}"})
                   for i in range(3)]
        assert [a.status_code for a in answers] == [429] * 3
        assert all(a.headers["retry-after"] == "1" and "retry" in a.json()["error"]["message"]
                   for a in answers)
        assert [f.hits for f in full] == [1, 1]     # the others were refused without a try
        fleet = httpx.get(gw.url + "/fleet").json()["replicas"]
        assert [(r["state"], r["busy"]) for r in fleet] == [("ready", True)] * 2
        assert httpx.get(gw.url + "/health/ready").status_code == 200
        assert gw.metric('ember_router_rejected_total{reason="replicas_busy"}') == 3
        for fake in full:
            fake.mode = "ok"
        deadline = time.monotonic() + 30
        while httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"}).status_code != 200:
            assert time.monotonic() < deadline, "the replicas never took requests again"
            time.sleep(0.05)
        assert gw.metric("ember_router_ejections_total") == 0
    finally:
        gw.close()
        for fake in full:
            fake.close()


def test_a_request_no_queue_takes_is_answered_as_is_and_marks_no_replica_busy():
    too_many, ok = FakeReplica("too_many"), FakeReplica("ok")
    gw = LiveGateway({"r1": too_many.url, "r2": ok.url}, policy="round-robin")
    try:
        gw.wait_ready()
        answers = [httpx.post(gw.url + "/v1/completions", json={"prompt": "hi", "n": 6})
                   for _ in range(4)]
        assert [a.status_code for a in answers] == [429, 200, 429, 200]
        assert "adds 6" in answers[0].json()["error"]["message"]
        assert answers[0].headers["retry-after"] == "1"
        assert (too_many.hits, ok.hits) == (2, 2)    # not retried on the other one
        assert [r["busy"] for r in httpx.get(gw.url + "/fleet").json()["replicas"]] == \
            [False, False]
    finally:
        gw.close()
        too_many.close()
        ok.close()


def test_a_stream_broken_after_its_first_bytes_ends_with_an_error_event():
    broken = FakeReplica("break_stream")
    gw = LiveGateway({"r0": broken.url})
    try:
        gw.wait_ready()
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={"prompt": "hi", "stream": True}) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
        assert json.loads(events[2][6:])["error"]["code"] == 502
        assert events[3] == "data: [DONE]"
        assert broken.hits == 1  # bytes had gone out: no retry
    finally:
        gw.close()
        broken.close()


def test_canary_share_then_promote_without_dropping_requests(replicas):
    gw = LiveGateway({"r1": replicas[0].url, "canary1": replicas[1].url},
                     policy="round-robin", rollout=Rollout(canary_percent=50,
                                                           rng=random.Random(0)))
    try:
        gw.wait_ready()
        for i in range(20):
            assert httpx.post(gw.url + "/v1/completions",
                              json={"prompt": f"q{i}", "max_tokens": 2}).status_code == 200
        to_canary = gw.metric('ember_router_routing_decisions_total{reason="round_robin",'
                              'replica="canary1"}')
        assert 4 <= to_canary <= 16
        assert httpx.post(gw.url + "/fleet/promote").json()["promoted"] == 1
        deadline = time.monotonic() + 10
        while {r["id"] for r in httpx.get(gw.url + "/fleet").json()["replicas"]} != {"canary1"}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(gw.url + "/fleet").json()["canary_percent"] == 0
        for i in range(3):
            httpx.post(gw.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
        assert gw.metric('ember_router_routing_decisions_total{reason="round_robin",'
                         'replica="canary1"}') == to_canary + 3
    finally:
        gw.close()


def test_shadow_is_mirrored_compared_and_kept_out_of_routing(replicas):
    gw = LiveGateway({"r1": replicas[0].url, "shadow1": replicas[1].url},
                     rollout=Rollout(shadow_percent=100))
    try:
        gw.wait_ready()
        for i in range(3):
            httpx.post(gw.url + "/v1/completions", json={
                "prompt": f"Count to {i}", "max_tokens": 6, "temperature": 0})
        httpx.post(gw.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4,
                                                    "stream": True, "temperature": 0})
        deadline = time.monotonic() + 20
        while gw.metric("ember_router_shadow_requests_total") < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the same model greedy on both sides: every answer matches
        assert gw.metric('ember_router_shadow_requests_total{outcome="match"}') == 4
        assert gw.metric('ember_router_routing_decisions_total{reason="prefix_miss",'
                         'replica="shadow1"}') == 0
        assert gw.metric("ember_router_shadow_latency_seconds_count") == 4
    finally:
        gw.close()


def test_admin_endpoints_follow_the_api_key(replicas):
    gw = LiveGateway({"r1": replicas[0].url}, server=ServerConfig(api_key="k3y"))
    try:
        assert httpx.get(gw.url + "/fleet").status_code == 401
        assert httpx.post(gw.url + "/fleet/rollback").status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.post(gw.url + "/fleet/rollback", headers=auth).status_code == 200
        assert httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(gw.url + "/health/live").status_code == 200
    finally:
        gw.close()


class NeverReady:
    """A launcher whose replicas never answer (a port nobody listens on)."""

    def __init__(self) -> None:
        self.started = 0

    def start(self, replica_id: str):
        from ember.router.replicas import RemoteHandle
        self.started += 1
        return RemoteHandle("http://127.0.0.1:9")


def test_a_cold_fleet_holds_requests_and_overflows_with_503_never_404():
    from concurrent.futures import ThreadPoolExecutor

    from ember.router.config import AutoscaleConfig
    launcher = NeverReady()
    gw = LiveGateway({}, launchers={"primary": launcher}, max_queue=2, hold_timeout_s=1.5,
                     autoscale=AutoscaleConfig(min_replicas=0, max_replicas=1,
                                               scale_to_zero_after_s=60))
    try:
        assert httpx.get(gw.url + "/health/ready").status_code == 200  # can start one
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: httpx.post(
                gw.url + "/v1/completions", json={"prompt": f"q{i}"}, timeout=30), range(4)))
        assert sorted(a.status_code for a in answers) == [503] * 4
        assert all(a.headers["retry-after"] for a in answers)
        assert launcher.started == 1      # one replica asked for, at once
        assert gw.metric('ember_router_rejected_total{reason="hold_queue_full"}') == 2
        assert gw.metric('ember_router_rejected_total{reason="hold_timeout"}') == 2
    finally:
        gw.close()


def test_rollback_drains_the_canary_and_keeps_serving(replicas):
    gw = LiveGateway({"r1": replicas[0].url, "canary1": replicas[1].url},
                     rollout=Rollout(canary_percent=100, rng=random.Random(0)))
    try:
        gw.wait_ready()
        assert httpx.post(gw.url + "/v1/completions",
                          json={"prompt": "to the canary", "max_tokens": 2}).status_code == 200
        assert gw.metric('ember_router_requests_total{replica="canary1"') == 1
        assert httpx.post(gw.url + "/fleet/rollback").json()["rolled_back"] == 1
        deadline = time.monotonic() + 10
        while {r["id"] for r in httpx.get(gw.url + "/fleet").json()["replicas"]} != {"r1"}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for i in range(3):
            assert httpx.post(gw.url + "/v1/completions",
                              json={"prompt": f"after {i}", "max_tokens": 2}).status_code == 200
        assert gw.metric('ember_router_requests_total{replica="r1"') == 3
    finally:
        gw.close()


def test_a_client_that_leaves_a_stream_aborts_it_on_the_replica(replicas):
    gw = LiveGateway({"r1": replicas[0].url})
    aborts = 'ember_request_aborts_total{reason="client_disconnect"}'
    try:
        gw.wait_ready()
        before = replicas[0].metric(aborts)
        with httpx.stream("POST", gw.url + "/v1/completions", json={
                "prompt": "go on", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as resp:
            next(resp.iter_lines())   # the stream has started; now hang up
        deadline = time.monotonic() + 20
        while replicas[0].metric(aborts) < before + 1:
            assert time.monotonic() < deadline, "the replica kept generating"
            time.sleep(0.05)
        replicas[0].wait_idle()
        assert gw.fleet.replicas["r1"].in_flight == 0
    finally:
        gw.close()
