"""Pressure: a bounded queue that refuses without queueing, 64 concurrent streams, and the
SIGTERM drain.

Loops are bounded in count and time, and talk only to 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest

from tests.server.conftest import LiveServer, free_port, start_server, wait_ready


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict,
                            events: list[str]) -> dict:
    """One streaming request: its status, text and usage; `events` gets "refused" or
    "served" when it ends, so callers can check the order in which answers came back."""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            events.append("refused")
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                    "body": r.json()}
        text, usage, done = "", None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
        events.append("served")
        return {"status": 200, "text": text, "usage": usage, "done": done}


def run_concurrently(url: str, bodies: list[dict], events: list[str] | None = None
                     ) -> list[dict]:
    events = [] if events is None else events

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*[stream_completion(client, url, b, events)
                                          for b in bodies])
    return asyncio.run(main())


def test_queue_overflow_is_refused_at_once_and_nothing_is_lost(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, max_waiting=2, engine_options={"max_num_seqs": 1})
    try:
        live.delay_steps(0.01)
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        results = run_concurrently(live.url, [body] * 12, events)
        refused = [r for r in results if r["status"] == 429]
        served = [r for r in results if r["status"] == 200]
        assert len(refused) + len(served) == 12
        assert refused and len(served) >= 2
        for r in refused:
            assert r["retry_after"] == "1"
            assert r["body"]["error"]["type"] == "rate_limit_error"
        # Refused at once, not after queueing: a full queue is what refuses, so each refusal
        # was decided while served requests still waited, and came back before the last of them.
        assert events[-1] == "served" and events.count("refused") == len(refused)
        assert all(r["done"] and r["usage"]["completion_tokens"] == 20 for r in served)
        live.wait_idle()
    finally:
        live.close()


def test_64_concurrent_streams_complete_with_correct_usage(server):
    bodies = [{"prompt": [10 + i, 20 + i, 30 + i], "max_tokens": 8 + i % 9, "ignore_eos": True,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
              for i in range(64)]
    results = run_concurrently(server.url, bodies)
    for body, r in zip(bodies, results):
        assert r["status"] == 200 and r["done"]
        assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": body["max_tokens"],
                              "total_tokens": 3 + body["max_tokens"],
                              "prompt_tokens_details": {"cached_tokens": 0}}
    server.wait_idle()


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # a drain long enough for the 400 tokens on a slow, shared machine: what is checked is
    # that they all arrive before the exit, not how fast
    proc = start_server(folder, port, "--drain-timeout", "300")
    try:
        wait_ready(proc, url)
        result: dict = {}
        started = threading.Event()

        def long_stream() -> None:
            body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                result["lines"] = lines

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        thread.join(300)
        assert proc.wait(300) == 0
        lines = [l for l in result["lines"] if l.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 400
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health/live", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
