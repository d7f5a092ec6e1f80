"""The load generator: streaming requests to any OpenAI-compatible server, timed per chunk.

Load is either a fixed concurrency (N workers, each sending its next request when the last
ends) or a request rate (arrivals with exponential gaps, or gamma gaps for bursty traffic),
optionally ramped up, bounded by a request count and/or a duration. Times come from `clock`
and the HTTP exchanges from `post` (both injectable, so tests can script them exactly).

Requests go out on aiohttp, as vLLM's and SGLang's benchmarks send them: the load generator
shares the machine with the server it measures, and per streamed chunk it takes about a third
of the CPU it took on httpx (docs/bench.md, "Load").
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from ember.bench.metrics import RequestRecord
from ember.bench.workloads import BenchRequest

Clock = Callable[[], float]


@dataclass
class LoadConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"            # or "chat", "embeddings"
    concurrency: int | None = 1              # None: use `rate`
    rate: float | None = None                # requests per second
    burstiness: float = 1.0                  # gamma shape of the gaps; 1.0 = Poisson
    ramp_up_s: float = 0.0
    num_requests: int | None = None
    duration_s: float | None = None
    timeout_s: float = 600.0
    cancel_fraction: float = 0.0
    force_output: bool = True                # ask for exactly max_tokens (ignore_eos, min_tokens)
    temperature: float = 0.0
    api_key: str | None = None
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def url(self) -> str:
        path = {"chat": "/chat/completions", "embeddings": "/embeddings"}.get(self.endpoint,
                                                                               "/completions")
        return self.base_url.rstrip("/") + path


def arrival_times(num: int, rate: float, burstiness: float, ramp_up_s: float,
                  rng: random.Random) -> list[float]:
    """Send times (s) for `num` requests: gamma gaps of mean 1/rate (shape `burstiness`;
    1.0 is a Poisson process), the rate rising linearly from 5% over `ramp_up_s`."""
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        gap = rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        ramp = 1.0 if ramp_up_s <= 0 else min(1.0, max(0.05, t / ramp_up_s))
        t += gap / ramp
    return times


def payload(req: BenchRequest, messages: list[dict[str, Any]] | None, cfg: LoadConfig
            ) -> dict[str, Any]:
    if req.inputs is not None:
        return {"input": req.inputs} | ({"model": cfg.model} if cfg.model else {}) | \
            cfg.extra_body
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.model:  # several, comma-separated (LoRA adapters): request i takes the i-th
        models = cfg.model.split(",")
        body["model"] = models[req.index % len(models)]
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = req.prompt
    if cfg.force_output:
        body |= {"ignore_eos": True, "min_tokens": req.max_tokens}
    return body | cfg.extra_body


class Exchange(Protocol):
    """One streamed HTTP response as the load generator reads it."""

    status: int

    async def text(self) -> str: ...

    def chunks(self) -> AsyncIterator[bytes]: ...   # the body, as it arrives


Post = Callable[[str, dict[str, Any]], AbstractAsyncContextManager[Exchange]]


class _AiohttpExchange:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response, self.status = response, response.status

    async def text(self) -> str:
        return await self.response.text()

    def chunks(self) -> AsyncIterator[bytes]:
        return self.response.content.iter_any()


def aiohttp_post(session: aiohttp.ClientSession) -> Post:
    @asynccontextmanager
    async def post(url: str, body: dict[str, Any]) -> AsyncIterator[Exchange]:
        async with session.post(url, json=body) as response:
            yield _AiohttpExchange(response)
    return post


async def lines_of(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a body that arrives in chunks (SSE: a line may span chunks), without
    their line ends."""
    pending = b""
    async for data in chunks:
        *complete, pending = (pending + data).split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


class Runner:
    def __init__(self, cfg: LoadConfig, clock: Clock = time.perf_counter,
                 post: Post | None = None,
                 progress: Callable[[list[RequestRecord]], None] | None = None) -> None:
        self.cfg, self.clock, self.progress = cfg, clock, progress
        self.post: Post | None = post   # None: aiohttp, one session per run
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.rng = random.Random(cfg.seed + 1)

    async def run(self, requests: list[BenchRequest]) -> list[RequestRecord]:
        if self.post is not None:
            return await self._run(self.post, requests)
        # a connection per request, closed after it: llama-server closes some kept-alive
        # connections after a streamed response although its headers say keep-alive, and the
        # next request sent on one failed ("Can not write request body": half of a
        # one-stream run); vLLM's benchmark also gave each request its own connection
        connector = aiohttp.TCPConnector(limit=max(64, self.cfg.concurrency or 0),
                                         force_close=True)
        async with aiohttp.ClientSession(connector=connector, headers=self.cfg.headers,
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            return await self._run(aiohttp_post(session), requests)

    async def _run(self, post: Post, requests: list[BenchRequest]) -> list[RequestRecord]:
        requests = self._bounded(requests)
        cancel = set(self.rng.sample(range(len(requests)),
                                     round(self.cfg.cancel_fraction * len(requests))))
        self.t0 = self.clock()
        if requests and all(r.at_s is not None for r in requests):
            await self._scheduled(post, requests, cancel)
        elif self.cfg.concurrency is not None:
            await self._fixed_concurrency(post, requests, cancel)
        else:
            await self._arrivals(post, requests, cancel)
        return sorted(self.records, key=lambda r: (r.start, r.index))

    def _bounded(self, requests: list[BenchRequest]) -> list[BenchRequest]:
        n = self.cfg.num_requests
        if n is None or n == len(requests):
            return list(requests)
        return [requests[i % len(requests)] for i in range(n)]

    def _expired(self) -> bool:
        d = self.cfg.duration_s
        return d is not None and self.clock() - self.t0 >= d

    async def _fixed_concurrency(self, post: Post, requests: list[BenchRequest],
                                 cancel: set[int]) -> None:
        queue = list(enumerate(requests))[::-1]
        width = min(self.cfg.concurrency, len(queue)) or 1

        async def worker(k: int) -> None:
            if self.cfg.ramp_up_s > 0:
                await asyncio.sleep(self.cfg.ramp_up_s * k / width)
            while queue and not self._expired():
                position, req = queue.pop()
                await self._session(post, req, position in cancel)
        await asyncio.gather(*(worker(k) for k in range(width)))

    async def _arrivals(self, post: Post, requests: list[BenchRequest],
                        cancel: set[int]) -> None:
        times = arrival_times(len(requests), self.cfg.rate, self.cfg.burstiness,
                              self.cfg.ramp_up_s, self.rng)
        await self._send_at(post, [(i, req, at) for i, (req, at) in
                                   enumerate(zip(requests, times))], cancel)

    async def _scheduled(self, post: Post, requests: list[BenchRequest],
                         cancel: set[int]) -> None:
        """Each request at its own `at_s` (a workload's fixed schedule)."""
        order = sorted(enumerate(requests), key=lambda pair: (pair[1].at_s, pair[0]))
        await self._send_at(post, [(i, req, req.at_s) for i, req in order], cancel)

    async def _send_at(self, post: Post, timed: list[tuple[int, BenchRequest, float]],
                       cancel: set[int]) -> None:
        """Each (position, request, second) sent that many seconds after the start, whatever
        is still running."""
        tasks = []
        for position, req, at in timed:
            delay = at - (self.clock() - self.t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if self._expired():
                break
            tasks.append(asyncio.create_task(self._session(post, req, position in cancel)))
        await asyncio.gather(*tasks)

    async def _session(self, post: Post, req: BenchRequest, cancel: bool) -> None:
        """One request, or every turn of a chat session (each turn sees the real replies)."""
        messages = list(req.messages) if req.messages is not None else None
        turns = [None, *req.user_turns] if req.session is not None else [None]
        for turn, user_text in enumerate(turns):
            if user_text is not None:
                messages.append({"role": "user", "content": user_text})
            record, reply = await self._one(post, req, messages, cancel and turn == 0)
            record.turn = turn if req.session is not None else None
            self.records.append(record)
            if self.progress:
                self.progress(self.records)
            if not record.ok or messages is None or req.session is None:
                return
            messages.append({"role": "assistant", "content": reply})

    async def _one(self, post: Post, req: BenchRequest,
                   messages: list[dict[str, Any]] | None, cancel: bool
                   ) -> tuple[RequestRecord, str]:
        start = self.clock()
        record = RequestRecord(index=req.index, start=start - self.t0,
                               target_prompt_tokens=req.target_prompt_tokens,
                               target_output_tokens=req.max_tokens, session=req.session,
                               kind=req.kind)
        text: list[str] = []
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await self._stream(post, req, messages, record, text, start, cancel)
        except TimeoutError:
            record.error, record.error_message = "timeout", f"over {self.cfg.timeout_s:g} s"
        except aiohttp.ClientError as e:
            record.error, record.error_message = "connection", str(e) or type(e).__name__
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            record.error, record.error_message = "protocol", f"unreadable stream: {e}"
        record.e2e = self.clock() - start
        if record.output_tokens is None:
            record.output_tokens = len(record.chunk_times)  # the server sent no usage
        return record, "".join(text)

    async def _stream(self, post: Post, req: BenchRequest,
                      messages: list[dict[str, Any]] | None, record: RequestRecord,
                      text: list[str], start: float, cancel: bool) -> None:
        body = payload(req, messages, self.cfg)
        async with post(self.cfg.url, body) as response:
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.error_message = (await response.text())[:500]
                return
            if req.inputs is not None:
                _read_embeddings(json.loads(await response.text()), record, len(req.inputs))
                return
            async with aclosing(lines_of(response.chunks())) as lines:
                async for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = "stream_error"
                        record.error_message = str(chunk["error"].get("message"))[:500]
                        break
                    piece = _chunk_text(chunk)
                    if piece:
                        now = self.clock() - start
                        record.chunk_times.append(now)
                        record.ttft = now if record.ttft is None else record.ttft
                        text.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        record.prompt_tokens = usage.get("prompt_tokens")
                        record.output_tokens = usage.get("completion_tokens")
                        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens")
                        record.usage_reported = True
                    if cancel and record.chunk_times:
                        record.cancelled = True
                        break


def _read_embeddings(body: dict[str, Any], record: RequestRecord, num_inputs: int) -> None:
    """A /v1/embeddings answer: one vector per input, and the usage."""
    if len(body["data"]) != num_inputs:
        record.error = "protocol"
        record.error_message = f"{len(body['data'])} vectors for {num_inputs} inputs"
        return
    record.num_inputs = num_inputs
    record.prompt_tokens = body["usage"]["prompt_tokens"]
    record.output_tokens = 0
    record.usage_reported = True


def print_progress(total: int) -> Callable[[list[RequestRecord]], None]:
    """A one-line progress bar on stderr (only when it is a terminal)."""
    start = time.monotonic()

    def show(records: list[RequestRecord]) -> None:
        if not sys.stderr.isatty():
            return
        done = len(records)
        failed = sum(r.error is not None for r in records)
        width = 30
        filled = int(width * min(done, total) / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                         f"({failed} failed) {time.monotonic() - start:6.1f} s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show
