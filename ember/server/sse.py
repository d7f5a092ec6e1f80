"""Server-sent events: the framing of a streamed generation and a response that stops the
moment its client leaves."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ember.errors import EmberError
from ember.request import CompletionOutput
from ember.server.errors import error_body
from ember.server.generation import Generation, end_reason

Chunks = Callable[[int, CompletionOutput], list[dict[str, Any]]]
UsageChunk = Callable[[dict[str, Any]], dict[str, Any]]

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(StreamingResponse):
    """SSE that stops the moment the client disconnects, even while nothing is being sent
    (queued, or in a long prefill): the cancelled generator aborts its requests."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                await self.stream_response(send)
                group.cancel_scope.cancel()
            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def sse_stream(gen: Generation, chunks: Chunks, usage_chunk: UsageChunk | None
                     ) -> AsyncIterator[bytes]:
    """Frame a generation as SSE: its chunks, the usage chunk if asked, then [DONE].

    An error after the stream has started becomes an `error` event; nothing ends silently.
    """
    ended = False
    try:
        async for index, delta in gen.deltas():
            for payload in chunks(index, delta):
                yield sse(payload)
        if usage_chunk is not None:
            yield sse(usage_chunk(gen.usage()))
        ended = True
        yield SSE_DONE
    except EmberError as e:
        gen.close(end_reason(e))
        ended = True
        yield sse(error_body(e.http_status, e.message, e.error_type, e.param))
        yield SSE_DONE
    finally:
        if not ended:
            gen.close("client_disconnect")


def event_stream(gen: Generation, chunks: Chunks, usage_chunk: UsageChunk | None
                 ) -> EventStreamResponse:
    return EventStreamResponse(sse_stream(gen, chunks, usage_chunk), headers=SSE_HEADERS)
