"""The gateway over a disaggregated fleet: each request goes to a prefill replica, then to a
decode replica that pulls the prompt's KV, and the client sees one ordinary answer. The
reference is one ordinary replica of the same engine options answering the same request:
greedy text and token counts must match. Afterwards every block of every replica is free."""
from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter

import httpx
import pytest

from ember.cli import build_parser, engine_config
from ember.config import DECODE_ROLE_PREFILL_TOKENS, SchedulerConfig
from ember.errors import ConfigError
from ember.router.cli import check_roles, role_urls, router_config
from ember.router.config import RouterConfig
from ember.router.disagg import (ANY_ROLE, WHOLE, Aside, AsideWindow, Queue, backed_up,
                                 whole_roles)
from ember.router.main import role_cpus
from ember.router.replicas import PromptBacklog
from tests.router.conftest import LiveGateway
from tests.router.fakes import FakeReplica
from tests.server.conftest import LiveServer, free_port, start_server, wait_ready
from tests.waiting import wait_for

BASE = {"max_model_len": 512, "kernels": "torch", "num_blocks": 128}
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
ROLES = {"r1": "prefill", "r2": "decode"}


@pytest.fixture(scope="module")
def trio(tiny_llama_dir):
    """One ordinary replica (the reference), one prefill, one decode replica."""
    folder, _ = tiny_llama_dir
    servers = {"single": LiveServer(folder, engine_options=BASE),
               "prefill": LiveServer(folder, engine_options=BASE | {"role": "prefill"}),
               "decode": LiveServer(folder, engine_options=BASE | {"role": "decode"})}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module")
def gateway(trio, tiny_llama_dir):
    folder, _ = tiny_llama_dir
    gw = LiveGateway({"r1": trio["prefill"].url, "r2": trio["decode"].url}, model=str(folder),
                     roles=ROLES)
    gw.wait_ready()
    yield gw
    gw.close()


def request(url: str, path: str, body: dict) -> tuple[str, dict, list[dict]]:
    """(text, usage, the stream's chunks) of one answer, streamed or not."""
    if not body.get("stream"):
        resp = httpx.post(url + path, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, answer["usage"], []
    chunks = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert "error" not in chunks[-1], chunks[-1]
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                   for chunk in chunks for c in chunk["choices"])
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    return text, usage, chunks


def body_for(path: str, prompt: str, stream: bool) -> dict:
    body = {"prompt": prompt} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": prompt}]}
    return body | GREEDY | ({"stream": True, "stream_options": {"include_usage": True}}
                            if stream else {})


def decode_loads(decode: LiveServer) -> float:
    name = decode.state.model_name
    return decode.metric(f'ember_kv_transfer_loads_total{{model_name="{name}"}}')


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_split_answer_matches_one_replica(trio, gateway, path, stream):
    prompt = f"Through the gateway, split in two ({path}, stream={stream}):"
    want, want_usage, _ = request(trio["single"].url, path, body_for(path, prompt, stream))
    split = gateway.metric('ember_router_disagg_requests_total{path="prefill_decode"}')
    loads = decode_loads(trio["decode"])
    text, usage, chunks = request(gateway.url, path, body_for(path, prompt, stream))
    assert text == want
    assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
    assert usage["completion_tokens"] == want_usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == \
        want_usage["prompt_tokens_details"]["cached_tokens"]
    assert gateway.metric('ember_router_disagg_requests_total{path="prefill_decode"}') == \
        split + 1
    assert decode_loads(trio["decode"]) == loads + 1     # its KV came from the prefill side
    if stream:   # one stream: one id, the assistant's message opened once, usage last
        assert len({c["id"] for c in chunks}) == 1
        assert sum("role" in c.get("delta", {}) for chunk in chunks
                   for c in chunk["choices"]) == (1 if "chat" in path else 0)
        assert chunks[-1]["usage"] is not None and chunks[0]["choices"]
    for server in (trio["prefill"], trio["decode"]):
        server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_that_ends_the_request_is_the_whole_answer(trio, gateway, stream):
    """max_tokens=1: the prefill replica's answer is all of it, sent as the client asked."""
    path = "/v1/chat/completions"
    body = body_for(path, f"One token only ({stream})", stream) | {"max_tokens": 1}
    before = gateway.metric('ember_router_disagg_requests_total{path="prefill_only"}')
    text, usage, chunks = request(gateway.url, path, body)
    want, want_usage, _ = request(trio["single"].url, path, body)
    assert (text, usage["completion_tokens"]) == (want, want_usage["completion_tokens"]) and \
        usage["prompt_tokens"] == want_usage["prompt_tokens"]
    assert gateway.metric('ember_router_disagg_requests_total{path="prefill_only"}') == \
        before + 1
    if stream:
        assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"]] == \
            [None, "length"]
    trio["prefill"].wait_idle()


def test_fleet_shows_roles(gateway):
    roles = {r["id"]: r["role"] for r in httpx.get(gateway.url + "/fleet").json()["replicas"]}
    assert roles == ROLES


def test_min_tokens_keeps_a_short_prompt_local(trio, tiny_llama_dir):
    folder, _ = tiny_llama_dir
    gw = LiveGateway({"r1": trio["prefill"].url, "r2": trio["decode"].url}, model=str(folder),
                     roles=ROLES, disagg_min_tokens=64)
    try:
        gw.wait_ready()
        name = trio["prefill"].state.model_name
        exports = f'ember_kv_transfer_exports_total{{model_name="{name}"}}'
        before = trio["prefill"].metric(exports)
        short = "A short prompt stays on the decode replica"
        text, _, _ = request(gw.url, "/v1/completions", body_for("/v1/completions", short,
                                                                  False))
        assert text == request(trio["single"].url, "/v1/completions",
                               body_for("/v1/completions", short, False))[0]
        assert gw.metric('ember_router_disagg_requests_total{path="kept_local"}') == 1
        assert trio["prefill"].metric(exports) == before          # never reached it
        long = "A prompt long enough to be worth moving between replicas. " * 8
        request(gw.url, "/v1/completions", body_for("/v1/completions", long, False))
        assert gw.metric('ember_router_disagg_requests_total{path="prefill_decode"}') == 1
        assert trio["prefill"].metric(exports) == before + 1
    finally:
        gw.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_decode_replica_is_retried_on_another(trio, tiny_llama_dir, stream):
    """A decode replica that fails before its first byte: the same request, with the same
    transfer parameters, goes to another decode replica (the pin still holds)."""
    folder, _ = tiny_llama_dir
    broken = FakeReplica("status_500")
    gw = LiveGateway({"r1": trio["prefill"].url, "r0": broken.url, "r2": trio["decode"].url},
                     model=str(folder), roles=ROLES | {"r0": "decode"}, policy="least-load")
    try:
        gw.wait_ready()
        prompts = [f"Retried on another decode replica, try {i} ({stream})" for i in range(2)]
        for prompt in prompts:   # least load, ties by id: the broken one first
            body = body_for("/v1/completions", prompt, stream)
            assert request(gw.url, "/v1/completions", body)[0] == \
                request(trio["single"].url, "/v1/completions", body)[0]
        assert broken.hits >= 1
        assert gw.metric('ember_router_retries_total{reason="status_500"}') >= 1
        for server in (trio["prefill"], trio["decode"]):
            server.wait_idle()
    finally:
        gw.close()
        broken.close()


def test_pin_released_when_no_decode_replica_answers(trio, tiny_llama_dir):
    """Every decode replica fails: the client gets the error, and the gateway releases the
    prefill replica's pin at once (not after --kv-pin-seconds)."""
    folder, _ = tiny_llama_dir
    broken = FakeReplica("status_500")
    gw = LiveGateway({"r1": trio["prefill"].url, "r2": broken.url}, model=str(folder),
                     roles=ROLES, eject_s=0.2)   # its tries wait out each ejection
    try:
        gw.wait_ready()
        resp = httpx.post(gw.url + "/v1/completions", timeout=60,
                          json=body_for("/v1/completions", "No decode replica takes it", False))
        assert resp.status_code == 500
        trio["prefill"].wait_idle(timeout_s=10)     # pins last 30 s unless released
        assert gw.metric("ember_router_disagg_pins_released_total") == 1
    finally:
        gw.close()
        broken.close()


def test_first_token_streams_before_the_decode_replica_answers(trio, gateway):
    """The decode replica's engine is held: the stream's first chunk (the prefill replica's
    token) reaches the client anyway; once released, the rest follows and the text is one
    replica's."""
    decode, gate = trio["decode"], threading.Event()
    real_step = decode.engine.core.step
    decode.delay_steps(gate=gate)
    prompt = "The first token comes at once"
    try:
        with httpx.stream("POST", gateway.url + "/v1/completions", timeout=60,
                          json=body_for("/v1/completions", prompt, True)) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: {"))
            first = json.loads(next(lines)[6:])
            assert not gate.is_set() and decode.engine.stats.num_running == 0
            gate.set()
            rest = [json.loads(line[6:]) for line in lines]
        text = "".join(c["text"] for chunk in [first, *rest] for c in chunk["choices"])
        assert text == request(trio["single"].url, "/v1/completions",
                               body_for("/v1/completions", prompt, False))[0]
    finally:
        gate.set()
        decode.engine.core.step = real_step
    decode.wait_idle()


def test_client_leaving_mid_stream_frees_both_sides(trio, gateway):
    decode = trio["decode"]
    real_step = decode.engine.core.step
    decode.delay_steps(0.05)
    try:
        body = body_for("/v1/completions", "A client that leaves early", True) | {
            "max_tokens": 300}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body,
                          timeout=60) as resp:
            lines = resp.iter_lines()
            seen = [line for line, _ in zip(lines, range(6)) if line.startswith("data: {")]
        assert len(seen) >= 2       # the first token's chunk, then the decode replica's
        for server in (trio["prefill"], decode):
            server.wait_idle(timeout_s=30)
    finally:
        decode.engine.core.step = real_step


@pytest.mark.slow
def test_killed_prefill_replica_still_answered(trio, tiny_llama_dir):
    """The only prefill replica (a process) is SIGKILLed after its answer, before the decode
    replica pulled: the stream goes on from a decode replica that computes the prompt itself
    (counted there). Requests sent after its death go whole to a decode replica (counted
    here). Every answer is one replica's."""
    folder, _ = tiny_llama_dir
    port = free_port()
    proc = start_server(folder, port, "--role", "prefill", "--kernels", "torch", "--dtype",
                        "float32", "--max-model-len", "512")
    url = f"http://127.0.0.1:{port}"
    decode, gate = trio["decode"], threading.Event()
    real_step = decode.engine.core.step
    name = decode.state.model_name
    unreachable = f'ember_kv_transfer_fallbacks_total{{model_name="{name}",reason="unreachable"}}'
    gw = None
    try:
        wait_ready(proc, url)
        gw = LiveGateway({"r1": url, "r2": decode.url}, model=str(folder), roles=ROLES)
        gw.wait_ready()
        before = decode.metric(unreachable)
        decode.delay_steps(gate=gate)    # the decode replica takes the request, pulls nothing
        body = body_for("/v1/completions", "The prefill replica dies mid-request", True)
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: {"))
            chunks = [json.loads(next(lines)[6:])]      # the prefill replica's token
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            gate.set()
            chunks += [json.loads(line[6:]) for line in lines]
        assert "".join(c.get("text") or "" for chunk in chunks for c in chunk["choices"]) == \
            request(trio["single"].url, "/v1/completions", body)[0]
        assert decode.metric(unreachable) == before + 1
        for stream in (False, True):
            body = body_for("/v1/completions", f"Asked after it died ({stream})", stream)
            assert request(gw.url, "/v1/completions", body)[0] == \
                request(trio["single"].url, "/v1/completions", body)[0]
        assert gw.metric("ember_router_disagg_fallbacks_total") == 2
        assert gw.metric('ember_router_disagg_requests_total{path="fallback"}') == 2
        decode.wait_idle()
    finally:
        gate.set()
        decode.engine.core.step = real_step
        if gw is not None:
            gw.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def route_args(tokens: list[str]):
    return build_parser().parse_args(["route", *tokens])


@pytest.mark.parametrize("tokens, message", [
    (["--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "both size"),
    (["--prefill-replicas", "1"], "needs both"),
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "at least 1"),
    (["--max-replicas", "3", "--prefill-replicas", "1", "--decode-replicas", "1"],
     "both size"),
    (["--role", "prefill"], "--role is not one of its options"),
])
def test_role_options_that_conflict_are_refused(tokens, message):
    with pytest.raises(ConfigError, match=message):
        check_roles(route_args(tokens), tokens)


def test_role_bounds_and_urls():
    tokens = ["--prefill-replicas", "1", "--decode-replicas", "2", "--max-decode-replicas",
              "4", "--min-prefill-replicas", "0", "--scale-to-zero-after", "60"]
    args = route_args(tokens)
    assert check_roles(args, tokens)
    from ember.config import ServerConfig
    config = router_config(args, ServerConfig())
    assert (config.prefill_autoscale.min_replicas, config.prefill_autoscale.max_replicas) == \
        (0, 1)
    assert (config.decode_autoscale.min_replicas, config.decode_autoscale.max_replicas) == \
        (2, 4)
    assert role_urls(["http://a:1#prefill", "http://b:2/#decode", "http://c:3"]) == [
        ("http://a:1", "prefill"), ("http://b:2", "decode"), ("http://c:3", "both")]
    with pytest.raises(ConfigError, match="not a role"):
        role_urls(["http://a:1#prefil"])
    with pytest.raises(ConfigError, match="needs a decode replica"):
        role_urls(["http://a:1#prefill", "http://c:3"])
    assert role_cpus([0, 1], 1, 1) == {"prefill": (0,), "decode": (1,)}
    assert role_cpus([0, 1, 2, 3], 1, 3) == {"prefill": (0,), "decode": (1, 2, 3)}
    assert role_cpus([0], 1, 1) == {"prefill": None, "decode": None}


@pytest.mark.slow
def test_route_starts_a_prefill_and_a_decode_replica(trio, tiny_llama_dir):
    """`ember route --prefill-replicas 1 --decode-replicas 1`: two local replicas with their
    roles, each on a core of its own; answers split between them are one replica's, and stay
    so once the prefill replica is SIGKILLed."""
    from tests.router.test_route_processes import Route, ready_count
    folder, _ = tiny_llama_dir
    route = Route(folder, "--prefill-replicas", "1", "--decode-replicas", "1")
    try:
        fleet = route.wait(lambda f: ready_count(f) == 2, "two replicas ready")
        assert sorted(r["role"] for r in fleet["replicas"]) == ["decode", "prefill"]
        for stream in (False, True):
            body = body_for("/v1/chat/completions", f"Through ember route ({stream})", stream)
            assert request(route.url, "/v1/chat/completions", body)[0] == \
                request(trio["single"].url, "/v1/chat/completions", body)[0]
        assert route.metric('ember_router_disagg_requests_total{path="prefill_decode"}') == 2
        prefill = next(r for r in fleet["replicas"] if r["role"] == "prefill")
        os.kill(prefill["pid"], signal.SIGKILL)
        body = body_for("/v1/completions", "After the prefill replica was killed", False)
        assert request(route.url, "/v1/completions", body)[0] == \
            request(trio["single"].url, "/v1/completions", body)[0]
    finally:
        route.close()


class FakeClock:
    """The gateway's clock for stepping aside, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_aside_window_steps_aside_after_idle_s_without_an_eligible_request():
    window = AsideWindow(idle_s=10, last_eligible=0.0)    # the gateway started at 0
    assert not window.stepped_aside(9.9) and whole_roles(window, 9.9) == WHOLE
    assert window.stepped_aside(10.0) and whole_roles(window, 10.0) == ANY_ROLE
    assert window.mode_changes(10.0) == {"aside": 1, "disaggregated": 0}
    back = window.after_eligible(12.0)                  # a prompt worth splitting
    assert not back.stepped_aside(12.0) and not back.stepped_aside(21.9)
    assert back.mode_changes(21.9) == {"aside": 1, "disaggregated": 1}
    assert back.stepped_aside(22.0) and back.mode_changes(22.0) == {"aside": 2,
                                                                    "disaggregated": 1}
    kept = back.after_eligible(15.0)                    # within the window: no change
    assert kept.mode_changes(24.9) == {"aside": 1, "disaggregated": 1}


def test_aside_window_never_steps_aside_with_idle_s_zero():
    window = AsideWindow(idle_s=0, last_eligible=0.0)
    assert not window.stepped_aside(1e9) and whole_roles(window, 1e9) == WHOLE
    assert window.after_eligible(1e9).mode_changes(2e9) == {"aside": 0, "disaggregated": 0}


def test_aside_routes_on_its_clock():
    clock = FakeClock()
    aside = Aside(5.0, clock)
    assert aside.route(eligible=False) == WHOLE          # a fleet starts disaggregated
    clock.now += 5
    assert aside.route(eligible=False) == ANY_ROLE
    assert aside.route(eligible=True) == WHOLE and aside.route(eligible=False) == WHOLE
    assert aside.view() == {"stepped_aside": False, "idle_s": 5.0,
                            "since_split_eligible_s": 0.0,
                            "mode_changes": {"aside": 1, "disaggregated": 1}}


def test_disagg_idle_s_option():
    tokens = ["--prefill-replicas", "1", "--decode-replicas", "1", "--disagg-idle-s", "5"]
    from ember.config import ServerConfig
    assert router_config(route_args(tokens), ServerConfig()).disagg_idle_s == 5.0
    assert router_config(route_args(tokens[:4]), ServerConfig()).disagg_idle_s == \
        RouterConfig.disagg_idle_s
    with pytest.raises(ConfigError, match="disagg_idle_s=-1"):
        RouterConfig(disagg_idle_s=-1)


STEPPED_ASIDE = "ember_router_disagg_stepped_aside"
LONG = "A prompt long enough to be worth moving between replicas. " * 8


def routed_to(gw: LiveGateway, reference: LiveServer, prompt: str) -> list[str]:
    """The replicas one request went to (by the gateway's routing decisions); its text is
    checked against one ordinary replica's."""
    def counts() -> dict[str, float]:
        lines = [line for line in httpx.get(gw.url + "/metrics").text.splitlines()
                 if line.startswith("ember_router_routing_decisions_total{")]
        return {rid: sum(float(line.rsplit(" ", 1)[1]) for line in lines
                         if f'replica="{rid}"' in line) for rid in ROLES}
    before = counts()
    body = body_for("/v1/completions", prompt, False)
    assert request(gw.url, "/v1/completions", body)[0] == \
        request(reference.url, "/v1/completions", body)[0]
    after = counts()
    return sorted(rid for rid in ROLES if after[rid] > before[rid])


def aside_gateway(trio, folder, clock=None, **options) -> LiveGateway:
    gw = LiveGateway({"r1": trio["prefill"].url, "r2": trio["decode"].url}, model=str(folder),
                     roles=ROLES, disagg_min_tokens=64, policy="round-robin",
                     **options | ({"clock": clock} if clock else {}))
    gw.wait_ready()
    return gw


def test_stepped_aside_spreads_short_prompts_until_a_long_one(trio, tiny_llama_dir):
    """No prompt worth splitting for --disagg-idle-s: whole requests go to both replicas (by
    the policy, round-robin here); a long prompt is split and sends the short ones back to
    the decode replica; the window elapsing steps aside again."""
    clock, single = FakeClock(), trio["single"]
    gw = aside_gateway(trio, tiny_llama_dir[0], clock, disagg_idle_s=10)
    try:
        assert gw.metric(STEPPED_ASIDE) == 0                   # a fleet starts disaggregated
        assert routed_to(gw, single, "Short, before any window") == ["r2"]
        clock.now += 10
        assert gw.metric(STEPPED_ASIDE) == 1
        assert httpx.get(gw.url + "/fleet").json()["disaggregation"]["stepped_aside"]
        spread = Counter(rid for i in range(4)
                         for rid in routed_to(gw, single, f"Short while aside {i}"))
        assert spread == {"r1": 2, "r2": 2}
        assert routed_to(gw, single, LONG) == ["r1", "r2"]      # split: prefill, then decode
        assert gw.metric('ember_router_disagg_requests_total{path="prefill_decode"}') == 1
        assert gw.metric(STEPPED_ASIDE) == 0
        for i in range(2):
            assert routed_to(gw, single, f"Short after the long one {i}") == ["r2"]
        clock.now += 10
        assert gw.metric(STEPPED_ASIDE) == 1
        assert gw.metric('ember_router_disagg_mode_changes_total{to="aside"}') == 2
        assert gw.metric('ember_router_disagg_mode_changes_total{to="disaggregated"}') == 1
        assert sorted(rid for i in range(2)
                      for rid in routed_to(gw, single, f"Aside again {i}")) == ["r1", "r2"]
        for server in (trio["prefill"], trio["decode"]):
            server.wait_idle()
    finally:
        gw.close()


def test_idle_s_zero_never_steps_aside(trio, tiny_llama_dir):
    clock = FakeClock()
    gw = aside_gateway(trio, tiny_llama_dir[0], clock, disagg_idle_s=0)
    try:
        clock.now += 1e6
        assert gw.metric(STEPPED_ASIDE) == 0
        assert not httpx.get(gw.url + "/fleet").json()["disaggregation"]["stepped_aside"]
        for i in range(3):
            assert routed_to(gw, trio["single"], f"Never aside {i}") == ["r2"]
    finally:
        gw.close()


def test_the_window_elapsing_steps_aside_on_the_real_clock(trio, tiny_llama_dir):
    gw = aside_gateway(trio, tiny_llama_dir[0], disagg_idle_s=0.2)
    try:
        wait_for(lambda: gw.metric(STEPPED_ASIDE) == 1, "stepped aside")
        routed_to(gw, trio["single"], LONG)
        assert gw.metric('ember_router_disagg_mode_changes_total{to="disaggregated"}') == 1
        wait_for(lambda: gw.metric('ember_router_disagg_mode_changes_total{to="aside"}') == 2,
                 "stepped aside again")
        trio["prefill"].wait_idle()
    finally:
        gw.close()


Q = Queue


@pytest.mark.parametrize("prefill, local, max_backlog, expected", [
    ([Q(4030, None)], Q(0, None), 2048, True),      # a long prompt ahead, none on decode
    ([Q(1000, None)], Q(0, None), 2048, False),     # a short wait: worth the prefill replica
    ([Q(4030, None), Q(0, None)], Q(0, None), 2048, False),   # one prefill replica is free
    ([Q(4030, None), Q(8060, None)], Q(0, None), 2048, True),  # every one is backed up
    ([Q(4030, None)], Q(4030, None), 2048, False),  # as far behind on decode: split
    ([Q(8060, None)], Q(4030, None), 2048, True),   # less far behind on decode: kept
    ([Q(2048, None)], Q(0, None), 2048, True),      # the threshold itself counts
    # measured rates (a prompt of 1000 tokens): at 300 tokens/s on decode, 3.3 s, against
    # 3.0 s behind 2048 tokens at 1000 tokens/s, and 13.1 s behind 12090
    ([Q(2048, 1000.0)], Q(0, 300.0), 2048, False),
    ([Q(12090, 1000.0)], Q(0, 300.0), 2048, True),
    ([Q(4030, 1000.0)], Q(0, None), 2048, True),    # not measured: the other side's rate
    ([Q(10**6, None)], Q(0, None), 0, False),       # 0: never
    ([], Q(0, None), 2048, False),                  # no prefill replica: not this rule's
])
def test_backed_up_prefill_replicas_keep_a_prompt_local(prefill, local, max_backlog,
                                                         expected):
    assert backed_up(prefill, local, 1000, max_backlog) is expected


def test_a_backlog_measures_the_rate_it_drains_at():
    """Tokens computed over the seconds any was outstanding; idle time does not count, and
    a failed request's tokens are not counted as computed."""
    backlog = PromptBacklog()
    assert backlog.rate(0.0) is None
    backlog.add(1000, now=10.0)
    backlog.add(1000, now=11.0)
    assert backlog.tokens == 2000 and backlog.rate(11.0) is None
    backlog.remove(1000, now=12.0, computed=True)
    assert backlog.rate(12.0) == 1000 / 2                  # busy since 10.0
    backlog.remove(1000, now=14.0, computed=True)
    assert backlog.tokens == 0 and backlog.rate(100.0) == 2000 / 4   # idle after 14.0
    backlog.add(500, now=100.0)
    backlog.remove(500, now=101.0, computed=False)
    assert backlog.rate(101.0) == 2000 / 5


def test_disagg_max_prefill_backlog_option():
    from ember.config import ServerConfig
    tokens = ["--prefill-replicas", "1", "--decode-replicas", "1"]
    config = router_config(route_args(tokens + ["--disagg-max-prefill-backlog", "512"]),
                           ServerConfig())
    assert config.disagg_max_prefill_backlog == 512
    assert router_config(route_args(tokens), ServerConfig()).disagg_max_prefill_backlog == \
        RouterConfig.disagg_max_prefill_backlog
    with pytest.raises(ConfigError, match="disagg_max_prefill_backlog=-1"):
        RouterConfig(disagg_max_prefill_backlog=-1)


def test_a_backed_up_prefill_replica_keeps_a_long_prompt_local(trio, tiny_llama_dir):
    """The prefill replica's backlog (prompt tokens the gateway has outstanding on it, set
    here as if others were computing) past --disagg-max-prefill-backlog: a long prompt is
    computed whole on the decode replica, with one replica's greedy text; counted apart from
    --disagg-min-tokens. Once the backlog is gone, or the decode replica's own is larger, it
    is split again, and a split's backlog share is given back when the prefill answers."""
    gw = LiveGateway({"r1": trio["prefill"].url, "r2": trio["decode"].url},
                     model=str(tiny_llama_dir[0]), roles=ROLES, policy="round-robin",
                     disagg_min_tokens=64, disagg_max_prefill_backlog=256)
    prefill = gw.fleet.replicas["r1"]
    kept = 'ember_router_disagg_requests_total{path="kept_local_backlog"}'
    split = 'ember_router_disagg_requests_total{path="prefill_decode"}'
    try:
        gw.wait_ready()
        prefill.backlog.tokens = 300
        assert routed_to(gw, trio["single"], LONG) == ["r2"]
        assert gw.metric(kept) == 1 and gw.metric(split) == 0
        assert routed_to(gw, trio["single"], "Short, under --disagg-min-tokens") == ["r2"]
        view = httpx.get(gw.url + "/fleet").json()["disaggregation"]["kept_local"]
        assert view["min_tokens"] == 1 and view["prefill_backlog"] == 1
        assert view["local_backlog_tokens"] == 0 and view["local_prompt_tokens_per_s"] > 0
        backlog = gw.gateway.kept.backlog
        backlog.tokens, backlog.tokens_done = 400, 0   # further behind, at an unknown rate
        assert routed_to(gw, trio["single"], LONG + "again") == ["r1", "r2"]
        backlog.tokens = 0
        prefill.backlog.tokens = 200                # under the threshold: worth the wait
        assert routed_to(gw, trio["single"], LONG + "once more") == ["r1", "r2"]
        assert gw.metric(kept) == 1 and gw.metric(split) == 2
        assert prefill.backlog.tokens == 200        # each split's own share given back
        shown = {r["id"]: r for r in httpx.get(gw.url + "/fleet").json()["replicas"]}
        assert shown["r1"]["prompt_backlog"] == 200 and shown["r1"]["prompt_tokens_per_s"] > 0
        for server in (trio["prefill"], trio["decode"]):
            server.wait_idle()
    finally:
        gw.close()


@pytest.mark.parametrize("argv, expected", [
    (["--role", "decode"], DECODE_ROLE_PREFILL_TOKENS),   # streams' gaps stay short
    (["--role", "prefill"], SchedulerConfig.prefill_tokens_with_decodes),
    ([], SchedulerConfig.prefill_tokens_with_decodes),
    (["--role", "decode", "--prefill-tokens-with-decodes", "128"], 128),
])
def test_a_decode_replica_takes_smaller_prompt_chunks_beside_decodes(argv, expected):
    args = build_parser().parse_args(["serve", *argv])
    assert engine_config(args).scheduler.prefill_tokens_with_decodes == expected
