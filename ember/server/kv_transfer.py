"""A prefill replica's pinned prompts, for decode replicas to pull (ember/kv_transfer/).

    POST   /kv_transfer/{id}/claim    hold the blocks for a pull; where the shared cache is
    POST   /kv_transfer/{id}/blocks   {"block_ids": [...]}: the blocks' bytes, streamed
    DELETE /kv_transfer/{id}          release them (a decode replica that has them, or a
                                      gateway whose client left)

404 means the blocks are not pinned (never were, were released, or expired): the decode
replica computes the prompt itself. A release that answers 200 proves the blocks were still
pinned, so the bytes pulled before it are the prompt's. The routes take the API key as the
others do, and keep serving while the server drains, so that pulls of prompts it already
answered can finish.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from ember.server.errors import NotFound
from ember.server.protocol import MAX_TRANSFER_BLOCKS, Strict
from ember.server.state import read_json_body, server_state

router = APIRouter()


class BlocksRequest(Strict):
    block_ids: list[int] = Field(min_length=1, max_length=MAX_TRANSFER_BLOCKS)


def _not_pinned(transfer_id: str) -> NotFound:
    return NotFound(f"transfer {transfer_id[:64]!r} is not pinned here (released, expired, or "
                    "never made); compute the prompt instead", param="transfer_id")


@router.post("/kv_transfer/{transfer_id}/claim")
async def claim(transfer_id: str, request: Request) -> JSONResponse:
    where = server_state(request).engine.kv_claim(transfer_id)
    if where is None:
        raise _not_pinned(transfer_id)
    return JSONResponse(where)


@router.post("/kv_transfer/{transfer_id}/blocks")
async def blocks(transfer_id: str, request: Request) -> StreamingResponse:
    body: BlocksRequest = await read_json_body(request, BlocksRequest)
    chunks = server_state(request).engine.kv_read(transfer_id, body.block_ids)
    if chunks is None:
        raise _not_pinned(transfer_id)
    # a sync iterator: starlette reads it in a worker thread, off the event loop
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.delete("/kv_transfer/{transfer_id}")
async def release(transfer_id: str, request: Request) -> JSONResponse:
    if not server_state(request).engine.kv_release(transfer_id):
        raise _not_pinned(transfer_id)
    return JSONResponse({"released": True})
