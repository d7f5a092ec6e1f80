"""A client that goes away is aborted in every phase, before that phase ends, and its KV
blocks are freed.

Each step is slowed to 20 ms so that every phase lasts long enough to be caught: queued (one
seat, taken), prefill (a long prompt in 8-token chunks), decode (streaming has begun). Promptness
is judged by order, not by a clock: the request leaves the engine with its phase unfinished (the
prompt part computed, fewer tokens than asked for, the blocker still running).
"""
from __future__ import annotations

import asyncio
import functools
import json
import socket

import pytest
from starlette.requests import Request

from ember.request import FinishReason, RequestStatus
from ember.server.errors import ClientDisconnected, read_body
from tests.server.conftest import LiveServer
from tests.waiting import wait_for as poll

# a request passes through a phase in milliseconds: poll often enough to catch it there
wait_for = functools.partial(poll, every_s=0.005)
LONG_PROMPT = list(range(1000, 1400))  # 400 tokens = 50 chunks of 8


@pytest.fixture(scope="module")
def slow_server(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_num_seqs": 1, "max_num_batched_tokens": 8})
    live.delay_steps(0.02)
    yield live
    live.close()


def send_request(server: LiveServer, body: dict, path: str = "/v1/completions") -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def find_request(server: LiveServer, prompt_len: int):
    for request in list(server.scheduler.requests.values()):
        if request.num_prompt_tokens == prompt_len:
            return request
    return None



def assert_aborted(server: LiveServer, request, aborts_before: float) -> None:
    """The request left the engine as an abort (not by finishing its work) and was counted."""
    wait_for(lambda: find_request(server, request.num_prompt_tokens) is None, "the abort")
    assert request.finish_reason is FinishReason.ABORT
    assert len(request.output_token_ids) < request.max_tokens
    wait_for(lambda: server.metric('ember_request_aborts_total{reason="client_disconnect"}')
             == aborts_before + 1, "the abort metric")


def aborts(server: LiveServer) -> float:
    return server.metric('ember_request_aborts_total{reason="client_disconnect"}')


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_while_queued(slow_server, stream):
    before = aborts(slow_server)
    blocker_sock = send_request(slow_server, {"prompt": [1, 2, 3], "max_tokens": 300,
                                              "ignore_eos": True})
    blocker = wait_for(lambda: find_request(slow_server, 3), "the blocker to run")
    queued = send_request(slow_server, {"prompt": [7] * 5, "max_tokens": 5, "stream": stream})
    request = wait_for(lambda: find_request(slow_server, 5), "the request to queue")
    assert request.status is RequestStatus.WAITING
    queued.close()
    assert_aborted(slow_server, request, before)
    assert request.num_computed_tokens == 0 and not request.output_token_ids
    assert not blocker.is_finished, "the queued request must not wait for its seat to leave"
    assert slow_server.scheduler.num_waiting == 0
    blocker_sock.close()
    slow_server.wait_idle()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_during_prefill(slow_server, stream):
    before = aborts(slow_server)
    sock = send_request(slow_server, {"prompt": LONG_PROMPT, "max_tokens": 5, "stream": stream})
    request = wait_for(lambda: find_request(slow_server, len(LONG_PROMPT)), "the request")
    wait_for(lambda: 0 < request.num_computed_tokens, "the prefill to start")
    assert request.num_computed_tokens < len(LONG_PROMPT) and not request.output_token_ids
    sock.close()
    assert_aborted(slow_server, request, before)
    assert request.num_computed_tokens < len(LONG_PROMPT) and not request.output_token_ids
    slow_server.wait_idle()


def test_disconnect_during_streamed_decode(slow_server):
    before = aborts(slow_server)
    sock = send_request(slow_server, {"prompt": [4, 5, 6, 7], "max_tokens": 300, "stream": True,
                                      "ignore_eos": True})
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(4096)
    request = find_request(slow_server, 4)
    assert request is not None and len(request.output_token_ids) >= 3
    sock.close()
    assert_aborted(slow_server, request, before)
    slow_server.wait_idle()


def test_disconnect_during_non_streamed_decode(slow_server):
    before = aborts(slow_server)
    sock = send_request(slow_server, {"prompt": [4, 5, 6, 8], "max_tokens": 300,
                                      "ignore_eos": True})
    request = wait_for(lambda: find_request(slow_server, 4), "the request")
    wait_for(lambda: len(request.output_token_ids) >= 3, "decoding")
    sock.close()
    assert_aborted(slow_server, request, before)
    slow_server.wait_idle()


def test_disconnect_from_chat_stream(slow_server):
    before = aborts(slow_server)
    sock = send_request(slow_server, {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 300, "stream": True, "ignore_eos": True},
                        path="/v1/chat/completions")
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(4096)
    sock.close()
    wait_for(lambda: aborts(slow_server) == before + 1, "the abort")
    slow_server.wait_idle()


def test_a_body_cut_short_is_a_client_that_left_not_a_fault():
    """Starlette reports a client gone mid-body as its own exception; read_body turns it into
    ClientDisconnected, a quiet 499, so it is never logged as an internal error (500)."""
    messages = [{"type": "http.request", "body": b'{"prompt": "hi', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop(0)
    request = Request({"type": "http", "method": "POST", "headers": [(b"content-length",
                                                                       b"100")]}, receive)
    with pytest.raises(ClientDisconnected):
        asyncio.run(read_body(request, 1000))
