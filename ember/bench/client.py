"""The load generator: streaming requests to any OpenAI-compatible server, timed per chunk.

Load is either a fixed concurrency (N workers, each sending its next request when the last
ends) or a request rate (arrivals with exponential gaps, or gamma gaps for bursty traffic),
optionally ramped up, bounded by a request count and/or a duration. Times come from `clock`
(injectable, so tests can script them exactly).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ember.bench.metrics import RequestRecord
from ember.bench.workloads import BenchRequest

Clock = Callable[[], float]


@dataclass
class LoadConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"            # or "chat"
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
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
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
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.model:
        body["model"] = cfg.model
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = req.prompt
    if cfg.force_output:
        body |= {"ignore_eos": True, "min_tokens": req.max_tokens}
    return body | cfg.extra_body


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
                 transport: httpx.AsyncBaseTransport | None = None,
                 progress: Callable[[list[RequestRecord]], None] | None = None) -> None:
        self.cfg, self.clock, self.transport, self.progress = cfg, clock, transport, progress
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.rng = random.Random(cfg.seed + 1)

    async def run(self, requests: list[BenchRequest]) -> list[RequestRecord]:
        requests = self._bounded(requests)
        cancel = set(self.rng.sample(range(len(requests)),
                                     round(self.cfg.cancel_fraction * len(requests))))
        limits = httpx.Limits(max_connections=max(64, self.cfg.concurrency or 0))
        async with httpx.AsyncClient(transport=self.transport, limits=limits, timeout=None,
                                     headers=self.cfg.headers) as client:
            self.t0 = self.clock()
            if self.cfg.concurrency is not None:
                await self._fixed_concurrency(client, requests, cancel)
            else:
                await self._arrivals(client, requests, cancel)
        return sorted(self.records, key=lambda r: (r.start, r.index))

    def _bounded(self, requests: list[BenchRequest]) -> list[BenchRequest]:
        n = self.cfg.num_requests
        if n is None or n == len(requests):
            return list(requests)
        return [requests[i % len(requests)] for i in range(n)]

    def _expired(self) -> bool:
        d = self.cfg.duration_s
        return d is not None and self.clock() - self.t0 >= d

    async def _fixed_concurrency(self, client: httpx.AsyncClient, requests: list[BenchRequest],
                                 cancel: set[int]) -> None:
        queue = list(enumerate(requests))[::-1]
        width = min(self.cfg.concurrency, len(queue)) or 1

        async def worker(k: int) -> None:
            if self.cfg.ramp_up_s > 0:
                await asyncio.sleep(self.cfg.ramp_up_s * k / width)
            while queue and not self._expired():
                position, req = queue.pop()
                await self._session(client, req, position in cancel)
        await asyncio.gather(*(worker(k) for k in range(width)))

    async def _arrivals(self, client: httpx.AsyncClient, requests: list[BenchRequest],
                        cancel: set[int]) -> None:
        times = arrival_times(len(requests), self.cfg.rate, self.cfg.burstiness,
                              self.cfg.ramp_up_s, self.rng)
        tasks = []
        for position, (req, at) in enumerate(zip(requests, times)):
            delay = at - (self.clock() - self.t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if self._expired():
                break
            tasks.append(asyncio.create_task(self._session(client, req, position in cancel)))
        await asyncio.gather(*tasks)

    async def _session(self, client: httpx.AsyncClient, req: BenchRequest, cancel: bool) -> None:
        """One request, or every turn of a chat session (each turn sees the real replies)."""
        messages = list(req.messages) if req.messages is not None else None
        turns = [None, *req.user_turns] if req.session is not None else [None]
        for turn, user_text in enumerate(turns):
            if user_text is not None:
                messages.append({"role": "user", "content": user_text})
            record, reply = await self._one(client, req, messages, cancel and turn == 0)
            record.turn = turn if req.session is not None else None
            self.records.append(record)
            if self.progress:
                self.progress(self.records)
            if not record.ok or messages is None or req.session is None:
                return
            messages.append({"role": "assistant", "content": reply})

    async def _one(self, client: httpx.AsyncClient, req: BenchRequest,
                   messages: list[dict[str, Any]] | None, cancel: bool
                   ) -> tuple[RequestRecord, str]:
        start = self.clock()
        record = RequestRecord(index=req.index, start=start - self.t0,
                               target_prompt_tokens=req.target_prompt_tokens,
                               target_output_tokens=req.max_tokens, session=req.session)
        text: list[str] = []
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await self._stream(client, req, messages, record, text, start, cancel)
        except TimeoutError:
            record.error, record.error_message = "timeout", f"over {self.cfg.timeout_s:g} s"
        except httpx.TransportError as e:
            record.error, record.error_message = "connection", str(e) or type(e).__name__
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            record.error, record.error_message = "protocol", f"unreadable stream: {e}"
        record.e2e = self.clock() - start
        if record.output_tokens is None:
            record.output_tokens = len(record.chunk_times)  # the server sent no usage
        return record, "".join(text)

    async def _stream(self, client: httpx.AsyncClient, req: BenchRequest,
                      messages: list[dict[str, Any]] | None, record: RequestRecord,
                      text: list[str], start: float, cancel: bool) -> None:
        body = payload(req, messages, self.cfg)
        async with client.stream("POST", self.cfg.url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"http_{response.status_code}"
                record.error_message = response.text[:500]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
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
