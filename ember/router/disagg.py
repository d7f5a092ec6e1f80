"""Disaggregated serving through the gateway: a prefill replica computes the prompt and its
first token, a decode replica pulls the prompt's KV and goes on (docs/disaggregated.md).

    request -> one the transfer can carry? (one prompt, n = 1, no echo, logprobs,
               structured output or tools)                    no: a decode replica, whole
            -> its uncached part >= --disagg-min-tokens?      no: a decode replica, whole
            -> every prefill replica backed up (>= --disagg-max-prefill-backlog uncached
               tokens outstanding) and the prompt computed sooner on a decode replica, at
               each side's measured rate?                     yes: a decode replica, whole
            -> a prefill replica (the policy's pick among prefill replicas), unstreamed, with
               kv_transfer_params {do_remote_decode: true}: the first token + transfer params
               (none of them answers: a decode replica, whole, computes the prompt itself)
            -> the first token to the client at once (a stream's first chunk)
            -> a decode replica (the policy's pick: the one holding the longest prefix) with
               those params, retried on another before its first byte; its text goes on
               from the first token, its usage covers the whole request

Stepping aside: while no request worth splitting has come for --disagg-idle-s (from the
gateway's start, at first), a whole request may go to a replica of any role, chosen as on an
ordinary fleet, so that a fleet serving only short prompts uses its prefill replicas too.
The next request worth splitting sends whole ones back to decode replicas only.

Backed-up prefill replicas: the gateway counts the uncached prompt tokens it has outstanding
on each prefill replica (sent, not yet answered), and the rate each side computes them at
(tokens over the seconds it had any outstanding). A prompt waits there behind that backlog;
on a decode replica only behind the prompts already kept local there. While every prefill
replica's backlog is at least --disagg-max-prefill-backlog, a prompt that would be computed
sooner on a decode replica (its backlog and the prompt at the decode side's rate, against
the prefill replica's backlog and the prompt at its rate) is computed there whole.

A client that leaves before a decode replica answered gets the prefill replica's pin
released (DELETE /kv_transfer/{id}): a decode replica that was pulling finds it gone and
drops its copy, so releasing is always safe.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace

import aiohttp
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from ember.errors import EmberError
from ember.router.fleet import RouteKeys
from ember.router.metrics import ANONYMOUS, RouterMetrics
from ember.router.proxy import SSE_HEADERS, Attempt, Proxy, Relay, Roles, Upstream
from ember.router.replicas import PromptBacklog
from ember.server.errors import error_body
from ember.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

PREFILL: Roles = ("prefill",)
DECODE: Roles = ("decode",)
WHOLE: Roles = ("decode", "both")   # where a request that is not split goes
# ... and where, once stepped aside (decode first: where no replica is up, a held request
# starts a decode one)
ANY_ROLE: Roles = ("decode", "both", "prefill")
RELEASE_TIMEOUT_S = 5.0
Body = CompletionRequest | ChatCompletionRequest


def unsupported(body: Body) -> str | None:
    """What in `body` a prefill replica's answer cannot carry to a decode replica (None:
    nothing; the request can be split)."""
    if body.kv_transfer_params is not None:
        return "kv_transfer_params"     # the client runs the stages itself
    if body.n != 1:
        return "n"
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            return "logprobs"
        if body.tools and body.tool_choice != "none":
            return "tools"
    else:
        if body.echo or len(body.prompt_list()) != 1:
            return "prompts"
        if body.logprobs is not None:
            return "logprobs"
    fmt = body.response_format or {}
    if body.structured_outputs or fmt.get("type", "text") != "text":
        return "structured_output"
    return None


@dataclass(frozen=True)
class AsideWindow:
    """Whether disaggregation steps aside: no split-eligible request (one a prefill replica
    would take) has arrived for `idle_s` seconds. Pure: the time is an argument."""

    idle_s: float           # 0: never steps aside
    last_eligible: float    # the last split-eligible arrival (at first: the gateway's start)
    num_returns: int = 0    # stepped-aside periods an eligible request ended

    def stepped_aside(self, now: float) -> bool:
        return self.idle_s > 0 and now - self.last_eligible >= self.idle_s

    def after_eligible(self, now: float) -> AsideWindow:
        """The window once a split-eligible request arrived at `now`."""
        return replace(self, last_eligible=now,
                       num_returns=self.num_returns + self.stepped_aside(now))

    def mode_changes(self, now: float) -> dict[str, int]:
        """Changes of mode so far, by the mode changed to (each period aside began once,
        and all but the current one ended)."""
        return {"aside": self.num_returns + self.stepped_aside(now),
                "disaggregated": self.num_returns}


def whole_roles(window: AsideWindow, now: float) -> Roles:
    """The roles a request that is not split may go to."""
    return ANY_ROLE if window.stepped_aside(now) else WHOLE


class Aside:
    """The gateway's window over the requests it routes, on its clock."""

    def __init__(self, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.window = AsideWindow(idle_s, clock())

    def route(self, eligible: bool) -> Roles:
        """Note one request (split-eligible or not); the roles it may go to whole."""
        now = self.clock()
        if eligible:
            self.window = self.window.after_eligible(now)
        return whole_roles(self.window, now)

    def view(self) -> dict:
        now = self.clock()
        return {"stepped_aside": self.window.stepped_aside(now),
                "idle_s": self.window.idle_s,
                "since_split_eligible_s": round(now - self.window.last_eligible, 3),
                "mode_changes": self.window.mode_changes(now)}


@dataclass(frozen=True)
class Queue:
    """One side's backlog now: uncached prompt tokens outstanding, and the prompt tokens a
    second it computes (measured; None: not yet)."""

    tokens: float
    rate: float | None


def backed_up(prefill: list[Queue], local: Queue, num_tokens: int, max_backlog: int) -> bool:
    """Whether a prompt of `num_tokens` uncached tokens is computed on a decode replica
    instead of a prefill replica: the least backlogged prefill replica has at least
    `max_backlog` tokens outstanding (0: never), and the prompt would be computed sooner
    behind the decode replicas' own backlog (`local`: prompts kept local this way, per decode
    replica) at their rate than behind that prefill replica's at its rate. A rate not
    measured yet is taken as the other side's. No prefill replica routable: not this
    rule's call."""
    if max_backlog <= 0 or not prefill:
        return False
    ahead = min(prefill, key=lambda q: q.tokens)
    if ahead.tokens < max_backlog:
        return False
    prefill_rate = ahead.rate or local.rate or 1.0
    local_rate = local.rate or prefill_rate
    return (local.tokens + num_tokens) / local_rate < \
        (ahead.tokens + num_tokens) / prefill_rate


@dataclass
class KeptLocal:
    """Requests kept whole on a decode replica by the prompt's length (`min_tokens`) or the
    prefill replicas' backlog (`prefill_backlog`), and the backlog of those kept for it (the
    decode replicas' own backlog)."""

    counts: Counter[str]
    backlog: PromptBacklog

    def view(self, now: float) -> dict:
        rate = self.backlog.rate(now)
        return {"min_tokens": self.counts["min_tokens"],
                "prefill_backlog": self.counts["prefill_backlog"],
                "local_backlog_tokens": self.backlog.tokens,
                "local_prompt_tokens_per_s": round(rate, 1) if rate else None}


@dataclass
class Split:
    """One request's way through both stages."""

    proxy: Proxy
    path: str
    raw: bytes
    headers: dict[str, str]
    keys: RouteKeys
    arrival: float
    chat: bool
    stream: bool
    include_usage: bool
    on_done: Callable[[], None]
    # runs a coroutine no request awaits (the gateway's in_background)
    background: Callable[[Coroutine], object]
    tenant: str = ANONYMOUS   # the key's tenant: each stage's answer is counted under it
    uncached_tokens: int = 0  # the prompt's part no prefill replica holds: its backlog share

    @property
    def metrics(self) -> RouterMetrics:
        return self.proxy.fleet.metrics

    async def run(self) -> Response:
        """The client's answer: one JSON body, or one stream."""
        try:
            first = await self.prefill()
        except BaseException:
            self.on_done()
            raise
        if isinstance(first, Response):
            self.on_done()
            return first
        if first is None:
            self.metrics.disagg_requests.labels("fallback").inc()
            return await self.whole()
        params = first.pop("kv_transfer_params", None)
        if params is None:   # the first token ended the request: its answer is the whole
            self.metrics.disagg_requests.labels("prefill_only").inc()
            self.on_done()
            if self.stream:
                return StreamingResponse(_as_stream(first, self.chat, self.include_usage),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            return JSONResponse(first)
        self.metrics.disagg_requests.labels("prefill_decode").inc()
        decode_raw = json.dumps(json.loads(self.raw) | {"kv_transfer_params": params}).encode()
        if self.stream:
            return StreamingResponse(self.stream_decode(first, params, decode_raw),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await self.decode(first, params, decode_raw)

    async def whole(self, roles: Roles = WHOLE) -> Response:
        """The request, unsplit, on a replica of `roles` (which computes the prompt itself)."""
        try:
            return await self.proxy.forward(self.path, self.raw, self.headers, self.keys,
                                            "primary", self.stream, self.arrival,
                                            on_done=self.on_done, roles=roles,
                                            tenant=self.tenant)
        except BaseException:
            self.on_done()
            raise

    async def prefill(self) -> dict | Response | None:
        """The prefill replica's answer (a dict); its error, when the request's own (a
        Response); None when no prefill replica could answer. It never waits for one: a
        decode replica can compute the prompt now."""
        body = json.loads(self.raw)
        body.pop("stream_options", None)
        raw = json.dumps(body | {"stream": False,
                                 "kv_transfer_params": {"do_remote_decode": True}}).encode()
        fleet, tried, reason = self.proxy.fleet, set(), "no_prefill_replica"
        for _ in range(self.proxy.config.max_tries):
            picked = fleet.choose("primary", self.keys, tried, PREFILL)
            if picked is None:
                break
            replica = picked[0]
            tried.add(replica.id)
            replica.backlog.add(self.uncached_tokens, time.monotonic())
            computed = False
            try:
                upstream = await self.proxy._try(replica, "POST", self.path, raw, self.headers)
            except Attempt as failed:
                fleet.release(replica)
                self.proxy._eject_after(replica, failed)
                reason = "prefill_busy" if failed.status == 429 else "prefill_failed"
                continue
            except BaseException:   # the client left: the replica was hung up on
                self.proxy._done(replica, 499, self.tenant)
                raise
            else:
                computed = upstream.response.status == 200
            finally:
                replica.backlog.remove(self.uncached_tokens, time.monotonic(), computed)
            return self._prefill_answer(upstream)
        self.metrics.disagg_fallbacks.labels(reason).inc()
        log.info("prefill stage failed (%s): a decode replica computes the prompt", reason)
        return None

    def _prefill_answer(self, upstream: Upstream) -> dict | Response:
        status = upstream.response.status
        self.proxy._done(upstream.replica, status, self.tenant)
        if status != 200:
            return Response(upstream.first, status_code=status,
                            media_type=upstream.response.content_type)
        return json.loads(upstream.first)

    async def decode(self, first: dict, params: dict, raw: bytes) -> Response:
        """The decode replica's answer, after the prefill replica's text."""
        try:
            resp = await self.proxy.forward(self.path, raw, self.headers, self.keys, "primary",
                                            False, self.arrival, on_done=self.on_done,
                                            roles=DECODE, tenant=self.tenant)
        except BaseException:
            self.on_done()
            self.release(params)
            raise
        if resp.status_code != 200:
            self.release(params)    # no decode replica took it (or it refused the request)
            return resp
        rest = json.loads(resp.body)
        choice, text = rest["choices"][0], _text(first)
        if self.chat:
            choice["message"]["content"] = text + (choice["message"].get("content") or "")
        else:
            choice["text"] = text + choice["text"]
        return JSONResponse(rest | {"id": first["id"]})

    async def stream_decode(self, first: dict, params: dict, raw: bytes
                            ) -> AsyncIterator[bytes]:
        """The first token's chunk at once, then the decode replica's stream (its chunks
        under the first one's id); an error event if no decode replica answers."""
        answered, relay = False, None
        try:
            yield _event(_first_chunk(first, self.chat, self.include_usage))
            try:
                upstream = await self.proxy.first_byte(self.path, raw, self.headers, self.keys,
                                                       "primary", self.arrival, roles=DECODE,
                                                       tenant=self.tenant)
            except EmberError as e:    # no decode replica now (busy, none startable)
                yield _error_event(e.http_status, str(e))
                return
            if isinstance(upstream, Response):
                yield _error_event(upstream.status_code, "every decode replica tried failed; "
                                   "retry")
                return
            answered = True
            relay = Relay(self.proxy, upstream, None, None, self.tenant)
            if upstream.response.content_type != "text/event-stream":  # its error, whole
                relay.status = upstream.response.status
                yield b"data: " + upstream.first + b"\n\ndata: [DONE]\n\n"
                return
            async for event in _events(relay.chunks()):
                yield _renamed(event, first["id"])
        finally:
            if relay is not None:
                relay.close()
            if not answered:
                self.release(params)
            self.on_done()

    def release(self, params: dict) -> None:
        """Unpin the prompt's blocks on the prefill replica, in the background."""
        self.metrics.disagg_pins_released.inc()
        self.background(release_pin(self.proxy.fleet.session, params, self.headers))


async def release_pin(session: aiohttp.ClientSession, params: dict,
                      headers: dict[str, str]) -> None:
    """DELETE the transfer on its prefill replica; gone already (404) or unreachable is
    fine: the pin expires by itself."""
    url = f"{params['remote_url']}/kv_transfer/{params['transfer_id']}"
    auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
    try:
        async with session.delete(url, headers=auth, timeout=aiohttp.ClientTimeout(
                total=RELEASE_TIMEOUT_S)) as resp:
            await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        log.info("could not release transfer %s at %s; it expires by itself",
                 params["transfer_id"], params["remote_url"])


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] or "" if "message" in choice else choice["text"]


def _first_chunk(answer: dict, chat: bool, include_usage: bool) -> dict:
    """The stream chunk of the prefill replica's text (its first token's, or less: text
    that might start a stop string is shown later)."""
    base = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}
    if chat:
        choice = {"index": 0, "delta": {"role": "assistant", "content": _text(answer)},
                  "logprobs": None, "finish_reason": None}
        base["object"] = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": _text(answer), "logprobs": None,
                  "finish_reason": None, "stop_reason": None}
        base["object"] = "text_completion"
    return base | {"choices": [choice]} | ({"usage": None} if include_usage else {})


async def _as_stream(answer: dict, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """A whole answer (one JSON body) as the stream a replica would have sent."""
    chunk = _first_chunk(answer, chat, include_usage)
    choice = answer["choices"][0]
    if chat:
        yield _event(chunk)
        chunk = chunk | {"choices": [{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": choice["finish_reason"],
                                      "stop_reason": choice.get("stop_reason")}]}
    else:
        chunk["choices"][0] |= {"finish_reason": choice["finish_reason"],
                                "stop_reason": choice.get("stop_reason")}
    yield _event(chunk)
    if include_usage:
        yield _event(chunk | {"choices": [], "usage": answer["usage"]})
    yield b"data: [DONE]\n\n"


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events (each ending in a blank line) out of chunks cut anywhere."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            yield event + b"\n\n"
    if pending:
        yield pending


def _renamed(event: bytes, answer_id: str) -> bytes:
    """A decode replica's chunk as part of the one answer: the first chunk's id, and no
    second opening of the assistant's message (the first chunk opened it)."""
    if not event.startswith(b"data: {"):
        return event
    chunk = json.loads(event[6:])
    if "choices" not in chunk:
        return event              # an error event
    chunk["id"] = answer_id
    for choice in chunk["choices"]:
        choice.get("delta", {}).pop("role", None)
    return _event(chunk)


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _error_event(status: int, message: str) -> bytes:
    return _event(error_body(status, message, "server_error")) + b"data: [DONE]\n\n"
