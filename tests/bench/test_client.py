"""The load generator against a fake OpenAI-compatible server whose token timings are
scripted on a fake clock, so the reported figures can be checked exactly."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

from ember.bench.client import LoadConfig, Runner, lines_of
from ember.bench.metrics import summarize
from ember.bench.workloads import BenchRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A streamed response: status, error body, and the body's chunks as they arrive."""

    def __init__(self, status: int, chunks=None) -> None:
        self.status, self._chunks = status, chunks

    async def text(self) -> str:
        return json.dumps({"error": {"message": "busy"}})

    def chunks(self):
        return self._chunks


class ScriptedServer:
    """Streams `script[i]` = (ttft, gaps, usage tokens) for the i-th request it receives,
    moving the fake clock to each chunk's time before handing the chunk over. Each event
    arrives in two pieces, split inside its line (as TCP may deliver it)."""

    def __init__(self, clock: FakeClock, scripts: list[dict], chat: bool = False) -> None:
        self.clock, self.scripts, self.chat = clock, scripts, chat
        self.bodies: list[dict] = []
        self.urls: list[str] = []

    @asynccontextmanager
    async def post(self, url: str, body: dict):
        self.urls.append(url)
        self.bodies.append(json.loads(json.dumps(body)))
        script = self.scripts[len(self.bodies) - 1]
        if "status" in script:
            yield Scripted(script["status"])
        else:
            yield Scripted(200, self._events(script, self.clock.now))

    async def _events(self, script: dict, t0: float):
        t = t0 + script["ttft"]
        times = [t]
        for gap in script["gaps"]:
            t += gap
            times.append(t)
        for k, when in enumerate(times):
            self.clock.now = when
            piece = {"delta": {"content": f"w{k} "}} if self.chat else {"text": f"w{k} "}
            event = b"data: " + json.dumps({"choices": [piece]}).encode() + b"\n\n"
            yield event[:9]
            yield event[9:]
            if script.get("error_after") == k:
                yield b'data: {"error": {"message": "boom"}}\n\n'
                return
        if script.get("usage", True):
            usage = {"prompt_tokens": 7, "completion_tokens": script["tokens"]}
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
        self.clock.now = times[-1] + script.get("tail", 0.0)
        yield b"data: [DONE]\n\n"


def run(scripts: list[dict], requests: list[BenchRequest], chat: bool = False, **cfg):
    clock = FakeClock()
    server = ScriptedServer(clock, scripts, chat)
    config = LoadConfig(base_url="http://fake/v1", model="m", endpoint="chat" if chat
                        else "completions", **cfg)
    runner = Runner(config, clock=clock, post=server.post)
    return asyncio.run(runner.run(requests)), server


def completion(i: int, max_tokens: int = 4) -> BenchRequest:
    return BenchRequest(index=i, max_tokens=max_tokens, prompt=f"prompt {i}")


def test_scripted_timings_give_exact_figures():
    scripts = [{"ttft": 0.25, "gaps": [0.01, 0.03, 0.02], "tokens": 4},
               {"ttft": 0.05, "gaps": [0.1], "tokens": 3, "tail": 0.5}]
    records, server = run(scripts, [completion(0), completion(1, 3)], concurrency=1)
    a, b = records
    assert a.ttft == pytest.approx(0.25) and a.e2e == pytest.approx(0.31)
    assert a.gaps == pytest.approx([0.01, 0.03, 0.02])
    assert a.tpot == pytest.approx((0.31 - 0.25) / 3)
    assert b.start == pytest.approx(0.31)                 # concurrency 1: after a ends
    assert b.ttft == pytest.approx(0.05) and b.e2e == pytest.approx(0.65)
    assert b.tpot == pytest.approx((0.65 - 0.05) / 2)     # E2E includes the tail after text
    assert a.output_tokens == 4 and a.prompt_tokens == 7 and a.usage_reported
    s = summarize(records)
    assert s["duration_s"] == pytest.approx(0.96)
    assert s["output_tok_per_s"] == pytest.approx(7 / 0.96)
    assert s["chunk_gap_s"]["max"] == pytest.approx(0.1)
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 4 and body["max_tokens"] == 4
    assert body["model"] == "m" and body["prompt"] == "prompt 0"
    assert server.urls[0] == "http://fake/v1/completions"


def test_lines_span_chunks_and_keep_their_order():
    async def chunks():
        for piece in (b"data: a", b"bc\r\n\ndata: ", b"x\n", b"", b"tail"):
            yield piece

    async def collect():
        return [line async for line in lines_of(chunks())]
    assert asyncio.run(collect()) == [b"data: abc", b"", b"data: x", b"tail"]


def test_errors_are_counted_by_kind_and_tokens_without_usage_are_counted_from_chunks():
    scripts = [{"status": 429}, {"status": 503},
               {"ttft": 0.1, "gaps": [0.1], "tokens": 2, "error_after": 1},
               {"ttft": 0.1, "gaps": [0.1, 0.1], "tokens": 3, "usage": False}]
    records, _ = run(scripts, [completion(i) for i in range(4)], concurrency=1)
    s = summarize(records)
    assert s["errors"] == {"http_429": 1, "http_503": 1, "stream_error": 1}
    assert s["completed"] == 1
    assert records[3].output_tokens == 3 and not records[3].usage_reported
    assert s["usage_reported"] is False


def test_cancel_fraction_cancels_after_the_first_chunk():
    scripts = [{"ttft": 0.1, "gaps": [0.1] * 5, "tokens": 6} for _ in range(10)]
    records, _ = run(scripts, [completion(i, 6) for i in range(10)], concurrency=1,
                     cancel_fraction=0.3, seed=3)
    cancelled = [r for r in records if r.cancelled]
    assert len(cancelled) == 3
    assert all(len(r.chunk_times) == 1 for r in cancelled)
    assert summarize(records)["cancelled"] == 3


def test_chat_sessions_send_the_real_replies_back():
    scripts = [{"ttft": 0.1, "gaps": [0.1], "tokens": 2} for _ in range(3)]
    session = BenchRequest(index=0, max_tokens=2, messages=[{"role": "user", "content": "a"}],
                           session=0, turn=0, user_turns=["b", "c"])
    records, server = run(scripts, [session], chat=True, concurrency=1)
    assert [r.turn for r in records] == [0, 1, 2]
    last = server.bodies[2]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == "w0 w1 " and last[4]["content"] == "c"


def test_num_requests_cycles_the_workload_and_duration_stops_sending():
    scripts = [{"ttft": 1.0, "gaps": [], "tokens": 1} for _ in range(10)]
    records, _ = run(scripts, [completion(0), completion(1)], concurrency=1, num_requests=5)
    assert [r.index for r in records] == [0, 1, 0, 1, 0]
    records, _ = run(scripts, [completion(i) for i in range(10)], concurrency=1,
                     duration_s=2.5)
    assert len(records) == 3  # sent at 0, 1, 2 s; at 3 s the duration is over


def test_rate_mode_sends_on_the_arrival_schedule():
    """Real clock, 50 req/s Poisson: every request is sent, in order, no earlier than its
    scheduled time (the schedule comes from the same seeded generator). How late a send may
    be depends on the machine's load, so only the order and the lower bound are checked."""
    import random
    import time

    from ember.bench.client import arrival_times
    server = ScriptedServer(FakeClock(), [{"ttft": 0.0, "gaps": [], "tokens": 1}] * 8)
    config = LoadConfig(base_url="http://fake/v1", concurrency=None, rate=50.0, seed=4)
    runner = Runner(config, clock=time.perf_counter, post=server.post)
    records = asyncio.run(runner.run([completion(i) for i in range(8)]))
    schedule = arrival_times(8, 50.0, 1.0, 0.0, random.Random(config.seed + 1))
    assert [r.index for r in records] == list(range(8))
    for r, at in zip(records, schedule):
        assert r.start >= at - 1e-3
    assert [r.start for r in records] == sorted(r.start for r in records)


def test_a_server_that_drops_kept_alive_connections_loses_no_request():
    """A real server on loopback that answers one request per connection and then leaves
    the connection hanging (as llama-server does with some kept-alive connections after a
    streamed response, though its headers say keep-alive): every request still completes,
    because each goes out on a connection of its own."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        served.append(len(served))
        body = b"".join(b"data: " + json.dumps({"choices": [{"text": f"w{k} "}]}).encode()
                        + b"\n\n" for k in range(3)) + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: "
                     b"timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)   # a next request on this connection is never read
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = LoadConfig(base_url=f"http://127.0.0.1:{port}/v1", concurrency=1,
                            timeout_s=5.0)
        async with server:
            return await Runner(config).run([completion(i) for i in range(3)])

    records = asyncio.run(main())
    assert [r.error for r in records] == [None, None, None], [r.error_message for r in records]
    assert [len(r.chunk_times) for r in records] == [3, 3, 3] and served == [0, 1, 2]


def test_a_fixed_schedule_sends_each_request_at_its_time_and_reports_kinds():
    """Requests with `at_s` go out on that schedule (real clock: only the order and the lower
    bound are checked), whatever concurrency says; each kind is summarized apart."""
    import time
    server = ScriptedServer(FakeClock(), [{"ttft": 0.0, "gaps": [0.0], "tokens": 2}] * 5)
    requests = [BenchRequest(index=i, max_tokens=2, prompt="p", at_s=at, kind=kind)
                for i, (at, kind) in enumerate([(0.0, "stream"), (0.0, "stream"),
                                                (0.1, "long"), (0.05, "long"),
                                                (0.0, "stream")])]
    config = LoadConfig(base_url="http://fake/v1", concurrency=1)
    runner = Runner(config, clock=time.perf_counter, post=server.post)
    records = asyncio.run(runner.run(requests))
    assert [r.index for r in records] == [0, 1, 4, 3, 2]
    for r in records:
        assert r.start >= requests[r.index].at_s - 1e-3
    by_kind = summarize(records)["by_kind"]
    assert {k: v["completed"] for k, v in by_kind.items()} == {"long": 2, "stream": 3}
    assert by_kind["stream"]["output_tokens"] == 6
