"""Forward one request to a replica: retry before the first byte, stream after it.

    pick -> send -> status?  connection error, 5xx: eject, back off, pick another
                   -> 429 (its queue is full): skip it for its Retry-After, pick another
                   -> 4xx/5xx the replica marks as the request's own: answered as it is
                   -> 2xx/4xx: a plain answer is read whole and returned
                   -> 2xx SSE: wait for its first chunk (still retryable), then relay chunk
                      by chunk; a failure after that ends the stream with an SSE error event

A request is held (not refused) while no replica is ready but one is starting or can be
started; only a full hold queue or a wait past `hold_timeout_s` answers 503 + Retry-After.
A request that finds every replica busy (429) and none starting is answered 429 + Retry-After
at once: the replicas are full, not broken, and the client's retry is the queue.
`roles` narrows the replicas a request may go to (disaggregated serving, disagg.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ember.errors import Overloaded
from ember.router.fleet import Fleet, RouteKeys
from ember.router.metrics import ANONYMOUS
from ember.router.policies import Decision
from ember.router.replicas import Replica
from ember.router.rollout import Capture
from ember.server.errors import FAULT_HEADER, RETRY_AFTER_S, Unavailable, error_body

log = logging.getLogger(__name__)

HOP_HEADERS = {"content-type", "authorization", "x-request-id"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRYABLE = {429, 500, 502, 503, 504}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
Roles = tuple[str, ...] | None   # the replica roles a request may go to (None: any)


@dataclass
class Upstream:
    """A replica's answer that passed the first byte."""

    replica: Replica
    response: aiohttp.ClientResponse
    first: bytes            # the first chunk of a stream, or the whole body otherwise


class Attempt(Exception):
    """One try failed before the first byte; `status` and `body` are kept for the client
    in case no other try succeeds."""

    def __init__(self, reason: str, status: int = 503, body: bytes = b"",
                 retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.body, self.retry_after = reason, status, body, retry_after


class Proxy:
    def __init__(self, fleet: Fleet, on_demand: Callable[[str, Roles], None]) -> None:
        self.fleet = fleet
        self.config = fleet.config
        self.on_demand = on_demand     # asks the autoscaler for a replica of a group now
        self.on_first_byte: Callable[[float], None] | None = None  # each replica TTFT (s)

    @property
    def held(self) -> int:
        """Requests waiting for a replica to become ready."""
        return self.fleet.held

    async def acquire(self, group: str, keys: RouteKeys, exclude: set[str], deadline: float,
                      roles: Roles = None) -> tuple[Replica, Decision, bool]:
        """A replica for this try, waiting (bounded) while none is ready; and whether it
        waited."""
        waited = False
        while True:
            picked = self.fleet.choose(group, keys, exclude, roles) or \
                self.fleet.choose(group, keys, set(), roles)
            if picked is not None:
                return picked[0], picked[1], waited
            if self.fleet.busy(group, time.monotonic(), roles):
                self.fleet.metrics.rejected.labels("replicas_busy").inc()
                raise Overloaded("every replica's queue is full; retry after the Retry-After "
                                 "seconds, or with backoff")
            if not self.fleet.can_serve_soon(group, roles):
                raise Unavailable(self.fleet.failures.get(group)
                                  or "no replica can serve this request now; retry later")
            if self.held >= self.config.max_queue:
                self.fleet.metrics.rejected.labels("hold_queue_full").inc()
                raise Unavailable(f"{self.held} requests are already waiting for a replica "
                                  "to start; retry later")
            self.on_demand(group, roles)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.fleet.metrics.rejected.labels("hold_timeout").inc()
                raise Unavailable("no replica became ready in time; retry later")
            await self._hold(remaining, roles)
            waited = True

    async def _hold(self, remaining: float, roles: Roles) -> None:
        self.fleet.held += 1
        self.fleet.held_roles.update(roles or ())
        try:
            if self.fleet.ready_event.is_set():
                await asyncio.sleep(min(0.05, remaining))  # ready, but not for this request
            else:
                await asyncio.wait_for(self.fleet.ready_event.wait(), min(remaining, 1.0))
        except asyncio.TimeoutError:
            pass
        finally:
            self.fleet.held -= 1
            self.fleet.held_roles.subtract(roles or ())

    async def forward(self, path: str, raw: bytes, headers: dict[str, str], keys: RouteKeys,
                      group: str, stream: bool, arrival: float, tap: Capture | None = None,
                      on_done: Callable[[], None] | None = None, method: str = "POST",
                      roles: Roles = None, tenant: str = ANONYMOUS) -> Response:
        """The replica's answer; `on_done` runs once it has been sent (or failed). Its
        status is counted under `tenant` (the key's tenant, or anonymous)."""
        try:
            upstream = await self.first_byte(path, raw, headers, keys, group, arrival, method,
                                             roles, tenant)
        except BaseException:
            if tap is not None:
                tap.close()
            raise
        if isinstance(upstream, Response):
            _finish(tap, on_done)
            return upstream
        resp, replica = upstream.response, upstream.replica
        if resp.content_type != "text/event-stream":
            self._done(replica, resp.status, tenant)
            if tap is not None:
                tap.feed(upstream.first)
            _finish(tap, on_done)
            return Response(upstream.first, status_code=resp.status,
                            media_type=resp.content_type, headers=kept_headers(resp))
        relay = Relay(self, upstream, tap, on_done, tenant)
        return RelayResponse(relay, status_code=resp.status, media_type="text/event-stream",
                             headers=SSE_HEADERS)

    async def first_byte(self, path: str, raw: bytes, headers: dict[str, str],
                         keys: RouteKeys, group: str, arrival: float, method: str = "POST",
                         roles: Roles = None, tenant: str = ANONYMOUS
                         ) -> Upstream | Response:
        deadline = arrival + self.config.hold_timeout_s
        tried: set[str] = set()
        last: Attempt | None = None
        for attempt in range(self.config.max_tries):
            if attempt:
                self.fleet.metrics.retries.labels(last.reason).inc()
                await asyncio.sleep(random.uniform(0, self.config.backoff_s * 2 ** attempt))
            replica, _, waited = await self.acquire(group, keys, tried, deadline, roles)
            if attempt == 0 and not waited:  # the gateway's own time, not a cold start's
                self.fleet.metrics.overhead.observe(time.monotonic() - arrival)
            tried.add(replica.id)
            sent = time.monotonic()
            try:
                upstream = await self._try(replica, method, path, raw, headers)
                if replica.first_byte_at is None:
                    replica.first_byte_at = time.monotonic()
                if self.on_first_byte is not None:
                    # the replica's time to first byte: a hold for a cold start, or tries that
                    # failed, say nothing of whether more replicas would answer sooner
                    self.on_first_byte(time.monotonic() - sent)
                return upstream
            except Attempt as failed:
                last = failed
                self.fleet.release(replica)
                self._eject_after(replica, failed)
            except BaseException:   # cancelled: the client left, the replica was hung up on
                self._done(replica, CLIENT_CLOSED_REQUEST, tenant)
                raise
        self._done_status(last.status, tenant)
        return Response(last.body or json.dumps(error_body(
            last.status, f"every replica tried failed ({last.reason}); retry later",
            "unavailable_error")).encode(), status_code=last.status,
            media_type="application/json", headers={"Retry-After": "1"})

    async def _try(self, replica: Replica, method: str, path: str, raw: bytes,
                   headers: dict[str, str]) -> Upstream:
        timeout = aiohttp.ClientTimeout(total=self.config.replica_timeout_s, sock_connect=5)
        try:
            resp = await self.fleet.session.request(method, replica.url + path, data=raw,
                                                    headers=headers, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise Attempt("connect") from e
        first = await read_first(resp)
        return Upstream(replica, resp, first)

    def _eject_after(self, replica: Replica, failed: Attempt) -> None:
        if failed.status == 429:   # full, not broken: skipped a while, never ejected
            wait_s = RETRY_AFTER_S if failed.retry_after is None else failed.retry_after
            replica.busy_until = time.monotonic() + min(max(wait_s, 0.0), self.config.eject_s)
            return
        self.fleet.eject(replica, failed.reason)

    def _done(self, replica: Replica, status: int, tenant: str) -> None:
        self.fleet.release(replica)
        self.fleet.metrics.requests.labels(replica.id, str(status), tenant).inc()

    def _done_status(self, status: int, tenant: str) -> None:
        self.fleet.metrics.requests.labels("none", str(status), tenant).inc()


class Relay:
    """One stream's chunks as they come from its replica. A replica lost mid-stream ends it
    with an error event and [DONE], never silently. `close` runs exactly once, whether the
    stream ended, failed, or its client left before it began."""

    def __init__(self, proxy: Proxy, upstream: Upstream, tap: Capture | None,
                 on_done: Callable[[], None] | None, tenant: str) -> None:
        self.proxy, self.upstream, self.tap, self.on_done = proxy, upstream, tap, on_done
        self.tenant = tenant
        self.status = upstream.response.status
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in relay_stream(self.upstream.response, self.upstream.first,
                                            self.tap.feed if self.tap is not None else None,
                                            self._failed):
                yield chunk
        finally:
            self.close()

    def _failed(self) -> None:
        self.status = 502
        self.proxy.fleet.eject(self.upstream.replica, "mid_stream")
        self.proxy.fleet.metrics.stream_errors.inc()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.upstream.response.close()   # a client that left aborts the replica's request
        self.proxy._done(self.upstream.replica, self.status, self.tenant)
        _finish(self.tap, self.on_done)


class RelayResponse(StreamingResponse):
    def __init__(self, relay: Relay, **kwargs) -> None:
        super().__init__(relay.chunks(), **kwargs)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()


async def read_first(resp: aiohttp.ClientResponse) -> bytes:
    """The first chunk of a stream, or the whole of a plain body; an Attempt (retry it
    elsewhere) for a retryable status the server does not mark as the request's own fault,
    an empty stream, or a connection lost before the first byte."""
    try:
        if resp.status in RETRYABLE and not _request_fault(resp):
            body = await resp.read()
            resp.release()
            raise Attempt(f"status_{resp.status}", resp.status, body,
                          _retry_after(resp.headers.get("Retry-After")))
        if resp.content_type == "text/event-stream":
            first = await resp.content.readany()
            if not first:
                raise Attempt("empty_stream")
        else:
            first = await resp.read()
            resp.release()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        resp.close()
        raise Attempt("disconnect") from e
    except BaseException:   # an Attempt, or cancelled: the connection goes, not reused
        resp.close()
        raise
    return first


async def relay_stream(resp: aiohttp.ClientResponse, first: bytes,
                       on_chunk: Callable[[bytes], None] | None,
                       on_failure: Callable[[], None]) -> AsyncIterator[bytes]:
    """`first`, then the rest of a streamed body as it comes. A connection lost after the
    first byte calls `on_failure` and ends the stream with an error event and [DONE], never
    silently (the client has bytes already: it cannot be retried)."""
    try:
        chunk = first
        while chunk:
            if on_chunk is not None:
                on_chunk(chunk)
            yield chunk
            chunk = await resp.content.readany()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        on_failure()
        message = "the server answering this stream failed after it had started; retry"
        yield b"data: " + json.dumps(error_body(502, message, "server_error")).encode() \
            + b"\n\n" + b"data: [DONE]\n\n"


def _finish(tap: Capture | None, on_done: Callable[[], None] | None) -> None:
    if tap is not None:
        tap.close()
    if on_done is not None:
        on_done()


def kept_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """The replica's headers that a plain answer keeps: whose fault it is, when to retry."""
    return {name: resp.headers[name] for name in (FAULT_HEADER, "Retry-After")
            if name in resp.headers}


def _request_fault(resp: aiohttp.ClientResponse) -> bool:
    """The replica says this request failed on its own (ember's RequestFailed, its
    --request-timeout, or more sequences than its --max-waiting takes at all): answered as it
    is, never retried, and the replica stays in rotation, or one poison request would take
    every replica it reaches out of routing."""
    return resp.headers.get(FAULT_HEADER, "").lower() == "request"


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None

