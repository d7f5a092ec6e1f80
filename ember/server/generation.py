"""The engine requests behind one HTTP request: submitted together, read as one stream of
(choice index, delta), and aborted together when the client leaves or an error ends them."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ember.engine.async_engine import Finished, RequestStream
from ember.errors import EmberError
from ember.kv_transfer.params import Export
from ember.request import CompletionOutput, TokenLogprob
from ember.server.engine_input import EngineInput
from ember.server.disconnect import unless_disconnected
from ember.server.errors import ClientDisconnected
from ember.server.metrics import RequestTracker
from ember.server.state import ServerState
from ember.tokenizer.answers import AnswerTokens


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

    def __init__(self, state: ServerState, request_id: str, work: EngineInput,
                 tracker: RequestTracker, answers: AnswerTokens | None = None) -> None:
        self.n = work.params.n
        self.answers = answers  # chat answers to remember by their text once they finish
        self.num_prompt_tokens = sum(len(p) for p in work.prompts)
        self.tracker = tracker
        self.streams: list[RequestStream] = []
        try:
            # all of a request's sequences are admitted together or refused (429) together
            state.engine.check_room(len(work.prompts) * self.n)
            for i, prompt in enumerate(work.prompts):
                self.streams.append(state.engine.submit(f"{request_id}-{i}", prompt,
                                                        work.params, work.options, work.grammar,
                                                        work.export_kv, work.remote))
        except BaseException:
            self.close("refused")
            raise
        self.choices = [Choice() for _ in range(len(work.prompts) * self.n)]
        self._queue_times: list[float] = []
        self.num_cached_tokens = 0
        # disaggregated: the prompt's blocks kept for a decode replica (a prefill replica's
        # answer); the first token, which the prefill replica's answer showed (a decode one's)
        self.export: Export | None = None
        self.num_tokens_shown_elsewhere = 1 if work.remote is not None else 0

    async def deltas(self) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """(choice index, delta) as the engine produces them, all prompts interleaved."""
        async for prompt_idx, item in _merge(self.streams):
            if isinstance(item, Finished):
                self._queue_times.append(item.queue_time_s)
                self.num_cached_tokens += item.num_cached_tokens
                self.export = item.export or self.export
                continue
            index = prompt_idx * self.n + item.index
            self.choices[index].add(item)
            self.tracker.on_output(index, len(item.token_ids))
            yield index, item
        if self.answers is not None:
            for choice in self.choices:
                if choice.finish_reason in ("stop", "length"):
                    self.answers.remember(choice.text, choice.token_ids)
        self.tracker.on_finish([c.finish_reason or "abort" for c in self.choices],
                               self.num_prompt_tokens, self._queue_times)

    def usage(self) -> dict[str, Any]:
        """The whole request's (a decode replica's counts the first token, which the
        prefill replica showed)."""
        completion = sum(len(c.token_ids) for c in self.choices) + \
            self.num_tokens_shown_elsewhere
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


def end_reason(error: EmberError) -> str:
    """The abort metric's reason for an error that ended a generation."""
    return "timeout" if error.http_status == 504 else "error"


async def collect(request: Request, gen: Generation) -> Generation:
    """Run a generation to its end (for a JSON response), aborting it if the client leaves."""
    async def drain() -> Generation:
        try:
            async for _ in gen.deltas():
                pass
        except EmberError as e:
            gen.close(end_reason(e))
            raise
        return gen
    try:
        return await unless_disconnected(request, drain())
    except ClientDisconnected:
        gen.close("client_disconnect")
        raise
