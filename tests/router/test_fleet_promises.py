"""Promises `ember serve` keeps that the gateway must keep too: keyed replicas' KV events,
request faults told from replica faults, client disconnects, fleet-wide gauges. The reference
is a replica on its own."""
from __future__ import annotations

import contextlib
import logging

import httpx
import pytest

from ember.config import ServerConfig
from ember.errors import RequestFailed
from ember.server.errors import FAULT_HEADER
from ember.server.protocol import CompletionRequest
from tests.router.conftest import LiveGateway
from tests.router.fakes import FakeReplica
from tests.server.conftest import LiveServer
from tests.waiting import wait_for

KEY = "k3y-of-the-fleet"
AUTH = {"Authorization": f"Bearer {KEY}"}
TINY = {"max_model_len": 512, "kernels": "torch"}


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir):
    """A replica behind an API key."""
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options=TINY, api_key=KEY)
    yield live
    live.close()



def test_a_keyed_replicas_events_reach_the_gateway_and_drive_routing(keyed, replicas,
                                                                     tiny_llama_dir):
    """A prefix the replica cached before the gateway started (so never routed by it) is
    learned from the keyed replica's /kv/events, and the next request with it goes there."""
    folder, _ = tiny_llama_dir
    system = "Keyed tenant's long system prompt, answered by one replica only. " * 6
    warm = httpx.post(keyed.url + "/v1/completions", headers=AUTH, json={
        "prompt": system + "First?", "max_tokens": 2, "temperature": 0})
    assert warm.status_code == 200
    gw = LiveGateway({"r1": replicas[0].url, "r2": keyed.url}, model=str(folder),
                     server=ServerConfig(api_key=KEY))
    try:
        gw.wait_ready()
        keys = gw.gateway.prompts.route_keys(CompletionRequest(prompt=system + "First?"),
                                             None, {16}, {}, True).block_keys[16]
        assert len(keys) >= 4
        wait_for(lambda: set(keys) <= gw.fleet.blocks["r2"].blocks,
                 "learned the keyed replica's blocks")
        answer = httpx.post(gw.url + "/v1/completions", headers=AUTH, json={
            "prompt": system + "Second?", "max_tokens": 2, "temperature": 0})
        assert answer.status_code == 200
        assert gw.metric('ember_router_routing_decisions_total{reason="prefix_hit",'
                         'replica="r2"}') == 1
        assert gw.metric("ember_router_kv_event_polls_failed_total") == 0
    finally:
        gw.close()


def test_refused_event_polls_are_counted_by_status_and_logged_once(keyed, caplog):
    gw = LiveGateway({"r1": keyed.url})       # the gateway has no key; its replica wants one
    try:
        with caplog.at_level(logging.WARNING, logger="ember.router.fleet"):
            gw.wait_ready()
            failed = 'ember_router_kv_event_polls_failed_total{replica="r1",status="401"}'
            wait_for(lambda: gw.metric(failed) >= 3, "counted three refused polls")
        warnings = [r for r in caplog.records if "/kv/events" in r.getMessage()]
        assert len(warnings) == 1
        assert "401" in warnings[0].getMessage() and "--api-key" in warnings[0].getMessage()
        assert gw.fleet.blocks["r1"].block_size is None
    finally:
        gw.close()


POISON_SEED = 4242   # the request the fault hits, wherever it goes


@contextlib.contextmanager
def poisoned(servers: list[LiveServer]):
    """Each server's engine fails the poison request, as ember fails one request that fails
    a step by itself (RequestFailed), and keeps serving the others. Yields the count of
    poison requests the servers received."""
    hits = [0]
    originals = [live.engine.submit for live in servers]

    def failing(submit):
        def submit_or_fail(request_id, prompt, params, *args, **kwargs):
            if params.seed == POISON_SEED:
                hits[0] += 1
                raise RequestFailed("the server failed while serving this request (injected)")
            return submit(request_id, prompt, params, *args, **kwargs)
        return submit_or_fail
    for live, submit in zip(servers, originals):
        live.engine.submit = failing(submit)
    try:
        yield hits
    finally:
        for live, submit in zip(servers, originals):
            live.engine.submit = submit


def test_a_poison_request_fails_once_and_takes_no_replica_out_of_routing(replicas):
    gw = LiveGateway({"r1": replicas[0].url, "r2": replicas[1].url}, policy="round-robin",
                     eject_s=60, hold_timeout_s=2)
    try:
        gw.wait_ready()
        with poisoned(replicas) as hits:
            poison = httpx.post(gw.url + "/v1/completions", json={
                "prompt": "poison", "max_tokens": 2, "seed": POISON_SEED})
            assert poison.status_code == 500 and "injected" in poison.json()["error"]["message"]
            assert poison.headers[FAULT_HEADER] == "request"
            assert hits[0] == 1                          # not retried on the other replica
            statuses = [httpx.post(gw.url + "/v1/completions", json={
                "prompt": f"fine {i}", "max_tokens": 2}).status_code for i in range(20)]
        assert statuses == [200] * 20
        assert gw.metric("ember_router_retries_total") == 0
        assert gw.metric("ember_router_ejections_total") == 0
        for replica_id in ("r1", "r2"):                   # both stayed in rotation
            assert gw.metric(f'ember_router_requests_total{{replica="{replica_id}",'
                             'status="200",') == 10
    finally:
        gw.close()


def test_a_replicas_request_timeout_is_the_requests_outcome(replicas):
    slow = FakeReplica("request_timeout")
    gw = LiveGateway({"r0": slow.url, "r1": replicas[0].url}, policy="round-robin",
                     eject_s=60)
    try:
        gw.wait_ready()
        answers = [httpx.post(gw.url + "/v1/completions", json={
            "prompt": f"q{i}", "max_tokens": 2}) for i in range(4)]
        assert sorted(a.status_code for a in answers) == [200, 200, 504, 504]
        assert slow.hits == 2                          # kept in rotation, never retried
        assert gw.metric("ember_router_retries_total") == 0
        assert gw.metric("ember_router_ejections_total") == 0
    finally:
        gw.close()
        slow.close()


@pytest.fixture(scope="module")
def slow(tiny_llama_dir):
    """A replica whose steps take 0.1 s: a long answer is still running when its client
    leaves."""
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options=TINY)
    live.delay_steps(0.1)
    yield live
    live.close()


LONG_ASK = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "go on"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_request_on_the_replica(slow, path, body, stream):
    gw = LiveGateway({"r1": slow.url})
    aborts = 'ember_request_aborts_total{reason="client_disconnect"}'
    try:
        gw.wait_ready()
        before = slow.metric(aborts)
        ask = body | LONG_ASK | {"stream": stream}
        if stream:
            with httpx.stream("POST", gw.url + path, json=ask) as resp:
                next(resp.iter_lines())          # the stream has started; now hang up
        else:
            with pytest.raises(httpx.ReadTimeout):   # the client gives up and hangs up
                httpx.post(gw.url + path, json=ask, timeout=httpx.Timeout(5, read=1))
        wait_for(lambda: slow.metric(aborts) >= before + 1, "aborted on the replica")
        slow.wait_idle()
        wait_for(lambda: gw.fleet.replicas["r1"].in_flight == 0 and gw.gateway.in_flight == 0,
                 "released at the gateway")
    finally:
        gw.close()


def test_the_fleets_totals_are_exported_under_a_replicas_gauge_names(slow):
    """Running requests as the replica counts them itself; held ones as waiting."""
    gw = LiveGateway({"r1": slow.url})
    running = "vllm:num_requests_running"
    streams, lines = [], []
    try:
        gw.wait_ready()
        for i in range(3):
            stream = httpx.stream("POST", gw.url + "/v1/completions", json={
                "prompt": f"run {i}", "stream": True} | LONG_ASK)
            streams.append(stream)
            lines.append(stream.__enter__().iter_lines())   # (dropped, it would hang up)
            next(lines[-1])                                  # running on the replica
        name = slow.state.model_name
        assert slow.metric(f'{running}{{model_name="{name}"}}') == 3      # the reference
        wait_for(lambda: gw.metric(f'{running}{{model_name="{name}"}}') == 3,
                 "counted the replica's running requests")
        assert gw.metric("vllm:num_requests_waiting") == 0
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
        gw.close()
    slow.wait_idle()


def test_held_requests_count_as_waiting():
    from concurrent.futures import ThreadPoolExecutor

    from ember.router.config import AutoscaleConfig
    from tests.router.test_gateway import NeverReady
    gw = LiveGateway({}, launchers={"primary": NeverReady()}, hold_timeout_s=3,
                     autoscale=AutoscaleConfig(min_replicas=0, max_replicas=1,
                                               scale_to_zero_after_s=60))
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(httpx.post, gw.url + "/v1/completions",
                                   json={"prompt": f"q{i}"}, timeout=30) for i in range(2)]
            wait_for(lambda: gw.metric("vllm:num_requests_waiting") == 2, "counted held", 3)
            assert gw.metric("ember_router_held_requests") == 2
            assert [a.result().status_code for a in answers] == [503, 503]
        assert gw.metric("vllm:num_requests_waiting") == 0
    finally:
        gw.close()


def test_a_shadow_mirror_is_held_until_it_is_done(replicas, slow):
    from ember.router.rollout import Rollout
    gw = LiveGateway({"r1": replicas[0].url, "shadow1": slow.url},
                     rollout=Rollout(shadow_percent=100))
    try:
        gw.wait_ready()
        answer = httpx.post(gw.url + "/v1/completions", json={
            "prompt": "mirror me", "max_tokens": 20, "ignore_eos": True, "temperature": 0})
        assert answer.status_code == 200
        assert len(gw.gateway.background) == 1     # the slow shadow still answers
        wait_for(lambda: gw.metric("ember_router_shadow_requests_total") == 1, "compared")
        wait_for(lambda: not gw.gateway.background, "let go of the mirror")
    finally:
        gw.close()
