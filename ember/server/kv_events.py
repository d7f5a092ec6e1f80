"""What this replica's prefix cache holds, for cache-aware routers.

    GET /kv/events?snapshot=1      every block cached now, and the seq to continue after
    GET /kv/events?after=SEQ       events after SEQ (poll with the last seq you saw)
    GET /kv/events/stream?after=SEQ  the same as an SSE stream that stays open

An event is {"seq", "type": "stored" | "removed", "block_hash", "parent_block_hash",
"num_tokens"}. Hashes are the chained 64-bit keys of ember/kv/prefix_cache.py, stable across
processes, so a router can tell which replica holds a prompt's prefix. A stored block with
fewer than "block_size" tokens is a finished request's partly filled last block: its hash is
that of its parent and its tokens, and it is reused by partial matching only. "dropped": true
means events older than the log's window (the last 10,000 by default) were lost: take a
snapshot again.

A snapshot is {"snapshot": [{"block_hash", "parent_block_hash", "num_tokens"}...], "cursor",
"block_size", "model"}: the cache at one instant, and the seq to poll `after` from. It is
taken without stopping the engine, so it may already hold a few blocks of the events just
after "cursor"; applying those events again (a stored block is held, a removed one is not)
gives the cache as it is, so a router that starts from a snapshot and applies the events
after its cursor knows the whole cache. It lists at most the KV pool's blocks (the log line
"KV cache: N blocks" at start): about 100 bytes of JSON each, some 0.5 MB for the default
model's 1 GiB cache. Start from one on first contact and after a gap; poll after that.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from ember.errors import EmberError
from ember.server.state import server_state

router = APIRouter()
POLL_S = 0.2


def _event(e) -> dict:
    d = asdict(e)
    return {"seq": d["seq"], "type": d["kind"], "block_hash": d["block_key"],
            "parent_block_hash": d["parent_key"], "num_tokens": d["num_tokens"]}


def _snapshot_body(held: dict[int, tuple[int | None, int]], cursor: int, block_size: int,
                   model: str) -> bytes:
    blocks = [{"block_hash": key, "parent_block_hash": parent, "num_tokens": num_tokens}
              for key, (parent, num_tokens) in held.items()]
    return json.dumps({"snapshot": blocks, "cursor": cursor, "block_size": block_size,
                       "model": model}).encode()


@router.get("/kv/events")
async def kv_events(request: Request, after: int = Query(-1), snapshot: bool = Query(False)
                    ) -> Response:
    state = server_state(request)
    if snapshot:
        held, cursor = state.engine.kv_snapshot()   # first: 503 while the model loads
        # a large pool's JSON takes a while: off the event loop, so streams keep flowing
        body = await asyncio.to_thread(_snapshot_body, held, cursor,
                                       state.engine.core.cache_info.block_size,
                                       state.model_name)
        return Response(body, media_type="application/json")
    events, dropped = state.engine.kv_events_after(after)
    return JSONResponse({"events": [_event(e) for e in events], "dropped": dropped,
                         "block_size": state.engine.core.cache_info.block_size,
                         "model": state.model_name})


@router.get("/kv/events/stream")
async def kv_event_stream(request: Request, after: int = Query(-1)) -> StreamingResponse:
    state = server_state(request)
    engine = state.engine
    engine.kv_events_after(after)  # fail now (503 while loading), not inside the stream

    async def events():
        seq = after
        # ends on a drain: an open stream must not hold the shutdown to its timeout
        while not state.draining:
            try:
                batch, dropped = engine.kv_events_after(seq)
            except EmberError:  # the engine died: the stream ends, as the server soon will
                return
            for e in batch:
                yield f"data: {json.dumps(_event(e) | {'dropped': dropped})}\n\n".encode()
                seq = e.seq
            await asyncio.sleep(POLL_S)
    return StreamingResponse(events(), media_type="text/event-stream")
