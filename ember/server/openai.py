"""/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize.

Each handler: parse and check the body, turn it into the engine's input (engine_input.py),
submit one engine request per prompt (all refused together if one cannot run), then either
stream SSE chunks (sse.py) or collect one JSON response. A client that goes away, at any phase,
aborts its requests at once (generation.py).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ember.errors import InvalidRequest
from ember.kv_transfer.params import export_params
from ember.request import CompletionOutput, TokenLogprob
from ember.server.engine_input import chat_input, chat_prompt, completion_input, with_transfer
from ember.server.generation import Generation, collect
from ember.server.metrics import RequestTracker
from ember.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from ember.server.sse import Chunks, UsageChunk, event_stream
from ember.server.state import (ServerState, arrival_time, read_json_body, request_tenant,
                                server_state)
from ember.server.tools import ToolCallParser
from ember.tokenizer.tokenizer import Tokenizer

router = APIRouter()
M = TypeVar("M", CompletionRequest, ChatCompletionRequest)


# -- logprobs in the two OpenAI shapes -------------------------------------------------------

def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob],
                        offset: int) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets start at `offset`."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def entry(token_id: int, token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}
    return {"content": [entry(lp.token_id, lp.token, lp.logprob)
                        | {"top_logprobs": [entry(t.token_id, t.token, t.logprob)
                                            for t in lp.top]} for lp in logprobs]}


# -- /v1/completions ---------------------------------------------------------------------------

async def parse_request(request: Request, model: type[M]
                        ) -> tuple[ServerState, M, RequestTracker]:
    """The body, validated, for the served model, asking only for what ember supports; and
    the request's tracker, timing from its arrival."""
    state = server_state(request)
    tenant = request_tenant(request)
    tracker = state.metrics.tracker(arrival_time(request), tenant.tenant if tenant else None)
    body = await read_json_body(request, model)
    tracker.adapter = state.check_model(body.model)
    state.engine.check_generates()  # before templating: an embedding model may have no template
    body.check_supported()
    return state, body, tracker


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state, body, tracker = await parse_request(request, CompletionRequest)
    work = with_transfer(await completion_input(state, body, request_tenant(request)), body,
                         request.headers.get("authorization"),
                         state.engine.config.kv_transfer.kv_peers)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(state, request_id, work, tracker)
    echo = [text for text in work.texts for _ in range(work.params.n)] if body.echo \
        else [""] * len(gen.choices)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": body.model or state.model_name}
    tokenizer = state.engine.tokenizer
    if body.stream:
        return event_stream(gen, completion_chunks(base, echo, tokenizer, body.include_usage),
                            _usage_chunk(base, body.include_usage))
    await collect(request, gen)
    return JSONResponse(_with_transfer(base | {"choices": completion_choices(
        gen, echo, tokenizer, body.logprobs is not None), "usage": gen.usage()}, body, gen,
        request))


def completion_chunks(base: dict[str, Any], echo: list[str], tokenizer: Tokenizer,
                      include_usage: bool) -> Chunks:
    """The streamed chunks of one completion delta; a choice's first carries its echo."""
    offsets = [len(e) for e in echo]
    echoed = [False] * len(echo)

    def chunks(index: int, delta: CompletionOutput) -> list[dict[str, Any]]:
        text = delta.text
        if not echoed[index]:
            echoed[index], text = True, echo[index] + text
        logprobs = None
        if delta.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, delta.logprobs, offsets[index])
        offsets[index] += len(delta.text)
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": _finish(delta), "stop_reason": delta.stop_reason}
        return [base | {"choices": [choice]} | _null_usage(include_usage)]
    return chunks


def completion_choices(gen: Generation, echo: list[str], tokenizer: Tokenizer,
                       with_logprobs: bool) -> list[dict[str, Any]]:
    return [{"index": i, "text": echo[i] + c.text,
             "logprobs": completion_logprobs(tokenizer, c.logprobs, len(echo[i]))
             if with_logprobs else None,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for i, c in enumerate(gen.choices)]


def _with_transfer(answer: dict[str, Any], body: CompletionRequest | ChatCompletionRequest,
                   gen: Generation, request: Request) -> dict[str, Any]:
    """A prefill replica's answer: the transfer parameters to send on to a decode replica
    (null when the first token ended the request), its choice left unfinished."""
    if body.kv_transfer_params is None or not body.kv_transfer_params.do_remote_decode:
        return answer
    if gen.export is None:
        return answer | {"kv_transfer_params": None}
    for choice in answer["choices"]:
        choice["finish_reason"] = None
    return answer | {"kv_transfer_params": export_params(gen.export, str(request.base_url))}


def _usage_chunk(base: dict[str, Any], include_usage: bool) -> UsageChunk | None:
    return (lambda usage: base | {"choices": [], "usage": usage}) if include_usage else None


def _finish(delta: CompletionOutput) -> str | None:
    return delta.finish_reason.value if delta.finish_reason is not None else None


def _null_usage(include_usage: bool) -> dict[str, Any]:
    return {"usage": None} if include_usage else {}


# -- /v1/chat/completions ----------------------------------------------------------------------

@dataclass
class ChatChoice:
    """Turns one choice's text into OpenAI chat deltas: content, or tool calls if tools."""

    parser: ToolCallParser | None
    started: bool = False

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        out = []
        for event in events:
            if event[0] == "content":
                out.append({"content": event[1]})
            elif event[0] == "call":
                call = event[2]
                out.append({"tool_calls": [{"index": event[1], "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": event[1],
                                            "function": {"arguments": event[2]}}]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.parser is not None and self.parser.calls:
            return "tool_calls"
        return reason


def _tool_calls(parser: ToolCallParser) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                          "arguments": c.arguments}}
            for c in parser.calls]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state, body, tracker = await parse_request(request, ChatCompletionRequest)
    work = with_transfer(await chat_input(state, body, request_tenant(request)), body,
                         request.headers.get("authorization"),
                         state.engine.config.kv_transfer.kv_peers)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation(state, request_id, work, tracker,
                     answers=None if work.functions else state.answers())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model or state.model_name}
    views = [ChatChoice(ToolCallParser() if work.functions else None)
             for _ in range(work.params.n)]
    tokenizer = state.engine.tokenizer
    if body.stream:
        return event_stream(gen, chat_chunks(base, views, tokenizer, body.include_usage),
                            _usage_chunk(base, body.include_usage))
    await collect(request, gen)
    return JSONResponse(_with_transfer(base | {"object": "chat.completion", "choices": chat_choices(
        gen, views, tokenizer, bool(body.logprobs)), "usage": gen.usage()}, body, gen, request))


def chat_chunks(base: dict[str, Any], views: list[ChatChoice], tokenizer: Tokenizer,
                include_usage: bool) -> Chunks:
    """The streamed chunks of one chat delta: a choice opens with its role, and closes with
    a chunk of its finish reason."""
    extra = _null_usage(include_usage)

    def chunks(index: int, delta: CompletionOutput) -> list[dict[str, Any]]:
        view, out = views[index], []
        if not view.started:
            view.started = True
            out.append(base | {"choices": [{"index": index, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]} | extra)
        logprobs = chat_logprobs(tokenizer, delta.logprobs) if delta.logprobs else None
        pieces = view.deltas(delta.text, delta.finish_reason is not None)
        if logprobs and not pieces:
            pieces = [{"content": ""}]
        for k, piece in enumerate(pieces):
            out.append(base | {"choices": [{"index": index, "delta": piece,
                                            "logprobs": logprobs if k == 0 else None,
                                            "finish_reason": None}]} | extra)
        if delta.finish_reason is not None:
            out.append(base | {"choices": [{
                "index": index, "delta": {}, "logprobs": None,
                "finish_reason": view.finish_reason(_finish(delta)),
                "stop_reason": delta.stop_reason}]} | extra)
        return out
    return chunks


def chat_choices(gen: Generation, views: list[ChatChoice], tokenizer: Tokenizer,
                 with_logprobs: bool) -> list[dict[str, Any]]:
    choices = []
    for i, (c, view) in enumerate(zip(gen.choices, views)):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if view.parser is not None:
            events = view.parser.feed(c.text) + view.parser.finish()
            content = "".join(e[1] for e in events if e[0] == "content").strip()
            message = {"role": "assistant", "content": content or None}
            if view.parser.calls:
                message["tool_calls"] = _tool_calls(view.parser)
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(tokenizer, c.logprobs) if with_logprobs
                        else None, "finish_reason": view.finish_reason(c.finish_reason),
                        "stop_reason": c.stop_reason})
    return choices


# -- models, tokenize, detokenize ----------------------------------------------------------------

def _model_card(state: ServerState, adapter: str | None = None,
                digest: str | None = None) -> dict[str, Any]:
    """The base model's card, or a LoRA adapter's (its base as `parent`, and the digest of
    its files, which salts its prefix-cache blocks: a router hashes its prompts so). Both
    say how /v1/embeddings pools (`last` keeps the prompt's blocks in the prefix cache)."""
    core = state.engine.core
    card = {"id": adapter or state.model_name, "object": "model", "created": state.created,
            "owned_by": "ember", "root": state.model_name, "parent": None,
            "max_model_len": state.max_model_len(),
            "pooling": core.pooling if core is not None else None,
            "role": state.engine.role}   # disaggregated serving: both, prefill or decode
    return card if adapter is None else card | {"parent": state.model_name, "digest": digest}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = server_state(request)
    cards = [_model_card(state)] + [_model_card(state, name, digest) for name, digest
                                    in state.engine.lora_digests().items()]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> JSONResponse:
    state = server_state(request)
    adapter = state.check_model(model_id)
    digest = None if adapter is None else state.engine.lora_digests().get(adapter)
    return JSONResponse(_model_card(state, adapter, digest))


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    body: TokenizeRequest = await read_json_body(request, TokenizeRequest)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        ids = await anyio.to_thread.run_sync(chat_prompt, state, body.messages,
                                             body.add_generation_prompt)
    else:
        ids = await anyio.to_thread.run_sync(state.engine.tokenizer.encode, body.prompt,
                                             body.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids),
                         "max_model_len": state.max_model_len()})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    body: DetokenizeRequest = await read_json_body(request, DetokenizeRequest)
    state.check_model(body.model)
    vocab = state.engine.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                             param="tokens")
    text = await anyio.to_thread.run_sync(partial(state.engine.tokenizer.decode, body.tokens,
                                                  skip_special_tokens=False))
    return JSONResponse({"prompt": text})
