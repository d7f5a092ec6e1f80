"""/v1/embeddings: OpenAI's embeddings API.

`input` is a string, a list of strings, a list of token ids, or a list of lists of token ids;
each input becomes one engine request that prefills beside generation under the same token
budget and is pooled into an L2-normalised vector (engine/embed.py). `dimensions` keeps the
first N values and normalises again (Matryoshka truncation); `encoding_format` base64 sends
each vector as its little-endian float32 bytes.
"""
from __future__ import annotations

import base64
import json
import uuid

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ember.engine.async_engine import Finished, RequestStream
from ember.engine.embed import EmbeddingOutput, check_embedding_input
from ember.errors import EmberError
from ember.request import PoolingParams
from ember.server.engine_input import adapter_options, tenant_options
from ember.server.errors import ClientDisconnected
from ember.server.disconnect import unless_disconnected
from ember.server.generation import end_reason
from ember.server.protocol import EmbeddingRequest
from ember.server.state import (ServerState, arrival_time, read_json_body, request_tenant,
                                server_state)
from ember.tokenizer.tokenizer import Tokenizer

router = APIRouter()


def encode_inputs(inputs: list[str | list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(i) if isinstance(i, str) else i for i in inputs]


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings")
async def create_embedding(request: Request) -> Response:
    state = server_state(request)
    tenant = request_tenant(request)
    tracker = state.metrics.tracker(arrival_time(request), tenant.tenant if tenant else None)
    body: EmbeddingRequest = await read_json_body(request, EmbeddingRequest)
    options = await adapter_options(state, body, tenant_options(body, tenant,
                                                                state.tenant_salts))
    tracker.adapter = options.lora
    inputs, pooling = await _engine_inputs(state, body)
    stream = state.engine.submit_embedding(f"embd-{uuid.uuid4().hex}", inputs, pooling, options)
    try:
        vectors, finished = await unless_disconnected(request, _collect(stream, len(inputs)))
    except ClientDisconnected:
        tracker.on_abort("client_disconnect")
        raise
    except EmberError as e:
        tracker.on_abort(end_reason(e))
        raise
    finally:
        stream.close()
    tracker.on_finish(["stop"] * len(inputs), finished.num_prompt_tokens,
                      [finished.queue_time_s])
    # 2048 vectors of a few hundred floats take a while to write: not on the event loop
    content = await anyio.to_thread.run_sync(
        _response_body, vectors, body.encoding_format, state.model_name,
        finished.num_prompt_tokens)
    return Response(content, media_type="application/json")


async def _engine_inputs(state: ServerState, body: EmbeddingRequest
                         ) -> tuple[list[list[int]], PoolingParams]:
    """The inputs as token ids (tokenized off the event loop), each checked, and the
    pooling asked for."""
    texts = body.inputs(state.config.max_embedding_inputs)
    engine = state.engine
    hidden = engine.embedding_size  # (503 while the model loads)
    pooling = PoolingParams(dimensions=body.dimensions)
    inputs = await anyio.to_thread.run_sync(encode_inputs, texts, engine.tokenizer)
    limit = state.max_model_len() or 0
    for index, ids in enumerate(inputs):  # each refusal names its input
        check_embedding_input(ids, pooling, limit, hidden, index)
    return inputs, pooling


async def _collect(stream: RequestStream, num_inputs: int
                   ) -> tuple[list[list[float]], Finished]:
    vectors: list[list[float]] = [[] for _ in range(num_inputs)]
    finished = None
    async for item in stream:
        if isinstance(item, EmbeddingOutput):
            vectors[item.index] = item.embedding
        elif isinstance(item, Finished):
            finished = item
    return vectors, finished


def _response_body(vectors: list[list[float]], encoding_format: str, model: str,
                   num_tokens: int) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)]
    return json.dumps({"object": "list", "data": data, "model": model,
                       "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}},
                      separators=(",", ":")).encode()
