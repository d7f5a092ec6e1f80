"""What this replica's prefix cache holds, for cache-aware routers.

    GET /kv/events?after=SEQ       events after SEQ (poll with the last seq you saw)
    GET /kv/events/stream?after=SEQ  the same as an SSE stream that stays open

An event is {"seq", "type": "stored" | "removed", "block_hash", "parent_block_hash",
"num_tokens"}. Hashes are the chained 64-bit keys of ember/kv/prefix_cache.py, stable across
processes, so a router can tell which replica holds a prompt's prefix. A stored block with
fewer than "block_size" tokens is a finished request's partly filled last block: its hash is
that of its parent and its tokens, and it is reused by partial matching only. "dropped": true
means events older than the log's window were lost; resynchronise from scratch.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from ember.errors import EmberError
from ember.server.state import server_state

router = APIRouter()
POLL_S = 0.2


def _event(e) -> dict:
    d = asdict(e)
    return {"seq": d["seq"], "type": d["kind"], "block_hash": d["block_key"],
            "parent_block_hash": d["parent_key"], "num_tokens": d["num_tokens"]}


@router.get("/kv/events")
async def kv_events(request: Request, after: int = Query(-1)) -> JSONResponse:
    state = server_state(request)
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
