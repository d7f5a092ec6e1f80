"""/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize.

Each handler: parse and check the body, turn prompts into token ids, submit one engine request
per prompt (all refused together if one cannot run), then either stream SSE chunks or collect
one JSON response. A client that goes away, at any phase, aborts its requests at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

import anyio

from ember.engine.async_engine import Finished, RequestStream
from ember.errors import EmberError, InvalidRequest
from ember.request import CompletionOutput, RequestOptions, SamplingParams, TokenLogprob
from ember.server.errors import ClientDisconnected, error_body
from ember.server.metrics import RequestTracker
from ember.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from ember.server.state import ServerState, read_json_body, server_state
from ember.server.tools import (ToolCallParser, check_tools, render_for_plain_template,
                                tool_constraint)
from ember.tokenizer.answers import AnswerTokens
from ember.tokenizer.tokenizer import Tokenizer

router = APIRouter()
T = TypeVar("T")
M = TypeVar("M", CompletionRequest, ChatCompletionRequest)


# -- running requests ------------------------------------------------------------------------

@dataclass
class Choice:
    """What one completion has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.value
            self.stop_reason = delta.stop_reason


class Generation:
    """The engine requests behind one HTTP request (one per prompt, each with n sequences)."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]],
                 params: SamplingParams, options: RequestOptions,
                 grammar: object | None = None, answers: AnswerTokens | None = None) -> None:
        self.n = params.n
        self.answers = answers  # chat answers to remember by their text once they finish
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.tracker: RequestTracker = state.metrics.tracker()
        self.streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                self.streams.append(state.engine.submit(f"{request_id}-{i}", prompt, params,
                                                        options, grammar))
        except BaseException:
            self.close("refused")
            raise
        self.choices = [Choice() for _ in range(len(prompts) * self.n)]
        self._queue_times: list[float] = []
        self.num_cached_tokens = 0

    async def deltas(self) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """(choice index, delta) as the engine produces them, all prompts interleaved."""
        async for prompt_idx, item in _merge(self.streams):
            if isinstance(item, Finished):
                self._queue_times.append(item.queue_time_s)
                self.num_cached_tokens += item.num_cached_tokens
                continue
            index = prompt_idx * self.n + item.index
            self.choices[index].add(item)
            self.tracker.on_output(len(item.token_ids))
            yield index, item
        if self.answers is not None:
            for choice in self.choices:
                if choice.finish_reason in ("stop", "length"):
                    self.answers.remember(choice.text, choice.token_ids)
        self.tracker.on_finish([c.finish_reason or "abort" for c in self.choices],
                               self.num_prompt_tokens, self._queue_times)

    def usage(self) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def close(self, reason: str) -> None:
        """Abort whatever has not finished (KV blocks are freed by the engine)."""
        if any(not s.finished for s in self.streams):
            self.tracker.on_abort(reason)
        for stream in self.streams:
            stream.close()


async def _merge(streams: list[RequestStream]
                 ) -> AsyncIterator[tuple[int, CompletionOutput | Finished]]:
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


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


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(gen: Generation, chunks, usage_chunk) -> AsyncIterator[bytes]:
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
        gen.close("timeout" if e.http_status == 504 else "error")
        ended = True
        yield sse(error_body(e.http_status, e.message, e.error_type, e.param))
        yield SSE_DONE
    finally:
        if not ended:
            gen.close("client_disconnect")


def _sse_headers() -> dict[str, str]:
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def collect(request: Request, gen: Generation) -> Generation:
    async def drain() -> Generation:
        try:
            async for _ in gen.deltas():
                pass
        except EmberError as e:
            gen.close("timeout" if e.http_status == 504 else "error")
            raise
        return gen
    try:
        return await unless_disconnected(request, drain())
    except ClientDisconnected:
        gen.close("client_disconnect")
        raise


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

def completion_prompts(prompts: list[str | list[int]], tokenizer: Tokenizer
                       ) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt; token-id prompts have no text."""
    return [(p, tokenizer.encode(p)) if isinstance(p, str) else (None, p) for p in prompts]


async def parse_request(request: Request, model: type[M]) -> tuple[ServerState, M]:
    """The body, validated, for the served model, asking only for what ember supports."""
    state = server_state(request)
    body = await read_json_body(request, model)
    state.check_model(body.model)
    body.check_supported()
    return state, body


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state, body = await parse_request(request, CompletionRequest)
    tokenizer = state.engine.tokenizer
    prompts = completion_prompts(body.prompt_list(), tokenizer)
    constraint = body.constraint()
    grammar = await state.engine.compile(constraint) if constraint else None
    params = body.sampling_params(body.max_tokens, body.logprobs, constraint)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(state, request_id, [ids for _, ids in prompts], params,
                     body.request_options(), grammar)
    created = int(time.time())
    echo = [(text if text is not None else tokenizer.decode(ids)) if body.echo else ""
            for text, ids in prompts for _ in range(params.n)]
    base = {"id": request_id, "object": "text_completion", "created": created,
            "model": state.model_name}
    if body.stream:
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
            return [base | {"choices": [choice]} | _null_usage(body.include_usage)]

        usage = (lambda u: base | {"choices": [], "usage": u}) if body.include_usage else None
        return EventStreamResponse(sse_stream(gen, chunks, usage), headers=_sse_headers())
    await collect(request, gen)
    choices = [{"index": i, "text": echo[i] + c.text,
                "logprobs": completion_logprobs(tokenizer, c.logprobs, len(echo[i]))
                if body.logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for i, c in enumerate(gen.choices)]
    return JSONResponse(base | {"choices": choices, "usage": gen.usage()})


def _finish(delta: CompletionOutput) -> str | None:
    return delta.finish_reason.value if delta.finish_reason is not None else None


def _null_usage(include_usage: bool) -> dict[str, Any]:
    return {"usage": None} if include_usage else {}


# -- /v1/chat/completions ----------------------------------------------------------------------

def chat_prompt(state: ServerState, messages: list, add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None,
                functions: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the conversation through the model's template. A template that knows
    tools gets them; for one that does not, tools and calls are written in (tools.py)."""
    template_messages = [m.as_template_message(i) for i, m in enumerate(messages)]
    template = state.chat_template()
    if template.knows_tools:
        text = template.render(template_messages, add_generation_prompt, tools=tools)
    else:
        text = template.render(render_for_plain_template(template_messages, functions),
                               add_generation_prompt)
    answers = [m["content"] for m in template_messages
               if m["role"] == "assistant" and m["content"] and not m.get("tool_calls")]
    return state.answers().encode(text, answers)


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
    state, body = await parse_request(request, ChatCompletionRequest)
    tokenizer = state.engine.tokenizer
    functions = check_tools(body.tools) if body.tools and body.tool_choice != "none" else None
    constraint = body.constraint()
    if functions:
        if constraint is not None:
            raise InvalidRequest("tools and response_format cannot be combined in one request",
                                 param="response_format")
        constraint = tool_constraint(functions, body.tool_choice or "auto",
                                     body.parallel_tool_calls)
    grammar = await state.engine.compile(constraint) if constraint else None
    prompt = chat_prompt(state, body.messages, body.add_generation_prompt,
                         body.tools if functions else None, functions)
    params = body.sampling_params(body.max_new_tokens(), body.num_logprobs(), constraint)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation(state, request_id, [prompt], params, body.request_options(), grammar,
                     answers=None if functions else state.answers())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name}
    views = [ChatChoice(ToolCallParser() if functions else None) for _ in range(params.n)]
    if body.stream:
        def chunks(index: int, delta: CompletionOutput) -> list[dict[str, Any]]:
            view, out = views[index], []
            extra = _null_usage(body.include_usage)
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

        usage = (lambda u: base | {"choices": [], "usage": u}) if body.include_usage else None
        return EventStreamResponse(sse_stream(gen, chunks, usage), headers=_sse_headers())
    await collect(request, gen)
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
                        "logprobs": chat_logprobs(tokenizer, c.logprobs) if body.logprobs
                        else None, "finish_reason": view.finish_reason(c.finish_reason),
                        "stop_reason": c.stop_reason})
    return JSONResponse(base | {"object": "chat.completion", "choices": choices,
                                "usage": gen.usage()})


# -- models, tokenize, detokenize ----------------------------------------------------------------

def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "ember", "max_model_len": state.max_model_len()}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(server_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> JSONResponse:
    state = server_state(request)
    state.check_model(model_id)
    return JSONResponse(_model_card(state))


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    body: TokenizeRequest = await read_json_body(request, TokenizeRequest)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        ids = chat_prompt(state, body.messages, body.add_generation_prompt)
    else:
        ids = state.engine.tokenizer.encode(body.prompt, body.add_special_tokens)
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
    text = state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})
