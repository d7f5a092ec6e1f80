"""AsyncEngine: one background thread steps the engine; asyncio callers stream their results.

    caller (event loop)                      engine thread
    generate() --- inbox: add / abort --->   drain inbox -> EngineCore.step() -> SequenceText
        <------ per-request asyncio.Queue --  one CompletionOutput delta per sequence per step

The engine thread owns EngineCore; nothing else touches it. torch releases the GIL inside its
kernels, so the event loop keeps serving HTTP while a step runs. A crash in the loop marks the
engine dead: every open stream gets EngineDead and `ready` turns False. A request that can
never run is refused before it is queued; a cancelled caller aborts its request at once.

A step that raises is not a crash: the requests it scheduled step again in halves, alone,
until the one that fails a step by itself is found. That request alone gets RequestFailed
(its blocks freed); the others go on, their tokens unchanged. Only a fault that fails
request after request with no step succeeding between them is taken as the engine's own.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ember.config import EngineConfig
from ember.constraint import Constraint
from ember.engine.cold_start import process_age_s
from ember.engine.core import EngineCore, StepFailed
from ember.engine.embed import PooledSequence
from ember.engine.memory import return_free_memory
from ember.engine.output import SequenceText
from ember.errors import (EmberError, EngineDead, EngineLoading, Overloaded, RequestFailed,
                          TooManySequences)
from ember.kv_transfer.connector import TransferStats
from ember.kv_transfer.params import Export, RemotePrefill
from ember.request import (CompletionOutput, FinishReason, PoolingParams, RequestOptions,
                           SamplingParams)
from ember.weights.loader import served_model_name

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class RequestTimeout(EmberError):
    http_status = 504
    error_type = "timeout_error"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    last_step_time: float = 0.0
    prefix_cache_queries: int = 0   # prompt tokens looked up
    prefix_cache_hits: int = 0      # of those, found cached
    prefix_cache_evictions: int = 0
    num_cached_blocks: int = 0
    spec_num_drafts: int = 0            # verifications of a request's drafts
    spec_num_draft_tokens: int = 0      # drafted tokens verified
    spec_num_accepted_tokens: int = 0   # of those, accepted
    kv_transfer: TransferStats | None = None   # a prefill or decode replica's (--role)
    # the share of a pipeline stage's time idle by the schedule (ModelRunner's bubble);
    # None without pipeline parallel
    pipeline_bubble: float | None = None


@dataclass(frozen=True)
class Finished:
    """The last item of a stream: per-request facts the caller reports."""

    num_prompt_tokens: int
    queue_time_s: float
    num_cached_tokens: int = 0   # prompt tokens served from the prefix cache
    export: Export | None = None   # a prefill replica's: the blocks kept for a decode replica


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sequences: list[str]
    num_prompt_tokens: int
    arrival_time: float
    first_scheduled: float | None = None
    num_cached_tokens: int = 0
    num_open: int = 0
    export: Export | None = None

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On the event loop: a step's outputs into their streams' queues, in order."""
    for queue, item in items:
        queue.put_nowait(item)


_STOP = object()
MAX_FAILURES_IN_A_ROW = 3  # requests failed alone with no good step between: the engine is sick


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, max_waiting: int = 256,
                 request_timeout_s: float | None = None, stall_timeout_s: float = 60.0,
                 core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> None:
        """`core_factory` builds the engine core in the engine thread (a simulated replica
        passes one that loads no model: ember/plan/replica.py); None: EngineCore, looked up
        when the thread starts."""
        self.config = config
        self.core_factory = core_factory
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self.core: EngineCore | None = None
        self.process_s: float | None = None  # the process's age when the engine began loading
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}      # by request id
        self._texts: dict[str, tuple[str, SequenceText | PooledSequence]] = {}  # by seq id
        self._loaded = threading.Event()
        self.num_failed_requests = 0
        self._failures_in_a_row = 0
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Load the model and start stepping, in the background thread (once: a later call
        does nothing, so `ember serve` can start loading before its server exists)."""
        if self._thread.ident is None:
            self._thread.start()

    async def wait_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._loaded.wait)
        if self.state is not EngineState.READY:
            raise EngineDead(f"the engine failed to start: {self.error}")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.state in (EngineState.READY, EngineState.LOADING):
            self.state = EngineState.STOPPED
        self._inbox.append(("stop", None))
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def ready(self) -> bool:
        """Loaded, warmed up, alive, and making progress whenever it has work."""
        if self.state is not EngineState.READY:
            return False
        stats = self.stats
        busy = stats.num_running + stats.num_waiting > 0
        return not (busy and time.monotonic() - stats.last_step_time > self.stall_timeout_s)

    @property
    def model_name(self) -> str:
        """The name to serve the model under: its file's stem or its folder's name."""
        return served_model_name(self.config.model)

    @property
    def tokenizer(self):
        return self._core().tokenizer

    def check_generates(self) -> None:
        """Raise InvalidRequest if the engine only embeds (--task embed)."""
        self._core().check_generates()

    @property
    def embedding_size(self) -> int:
        """The length of the model's embeddings (its hidden size)."""
        return self._core().model_config.hidden_size

    # -- requests --------------------------------------------------------------------------

    async def compile(self, constraint: Constraint) -> object:
        """Compile a structured-output constraint in a compile thread, under a time limit, so
        the engine keeps stepping meanwhile (a repeat comes from the cache at once)."""
        return await self._core().grammars.compile_async(constraint)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               options: RequestOptions = RequestOptions(),
               grammar: object | None = None, export_kv: bool = False,
               remote: RemotePrefill | None = None) -> "RequestStream":
        """Queue a request and return its stream. Raises at once, queueing nothing, if the
        request can never run, the queue is full, or the engine is not ready.

        Disaggregated (one sequence only): `export_kv` computes the prompt and its first
        token and keeps the blocks for a decode replica (the stream's Finished carries the
        Export); `remote` goes on from another replica's prompt and first token, whose text
        the stream leaves out (that replica's answer had it)."""
        core = self._core()
        children = params.fan_out()
        if (export_kv or remote is not None) and len(children) > 1:
            raise RequestFailed("a disaggregated request has one sequence (n=1)")
        for child in children:
            core.check_request(prompt_token_ids, child)
        if request_id in self._streams:
            raise RequestFailed(f"request id {request_id!r} is already running")
        self.check_room(len(children))
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(),
                         [f"{request_id}-{i}" for i in range(len(children))],
                         len(prompt_token_ids), time.monotonic())
        self._streams[request_id] = stream
        if params.constraint is not None and grammar is None:
            raise RequestFailed("a constrained request needs its grammar compiled first "
                                "(await AsyncEngine.compile)")
        self._inbox.append(("add", (request_id, prompt_token_ids, children, options, grammar,
                                    export_kv, remote)))
        self._wake.set()
        deadline = None if self.request_timeout_s is None else \
            time.monotonic() + self.request_timeout_s
        return RequestStream(self, request_id, stream, deadline)

    # -- LoRA adapters -----------------------------------------------------------------------

    def lora_names(self) -> list[str]:
        """The loaded adapters' names (requests name one as their model)."""
        return [] if self.core is None else self.core.loras.names()

    def lora_digests(self) -> dict[str, str]:
        """Each loaded adapter's digest of its files, by name (the salt of its KV blocks)."""
        return {} if self.core is None else self.core.loras.digests()

    async def load_lora(self, name: str, path: str) -> None:
        """Read and register an adapter in a worker thread; the engine keeps stepping."""
        await asyncio.to_thread(self._core().loras.add, name, path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter; requests already running with it finish with it."""
        self._core().loras.remove(name)

    async def prepare_lora(self, name: str) -> None:
        """Make an adapter resident before its request is queued: an evicted one is read from
        its file again here, in a worker thread, not on the engine thread."""
        await asyncio.to_thread(self._core().loras.acquire, name)
    def submit_embedding(self, request_id: str, inputs: list[list[int]],
                         pooling: PoolingParams = PoolingParams(),
                         options: RequestOptions = RequestOptions()) -> "RequestStream":
        """Queue one embedding per input (engine/embed.py), all on one stream: an
        EmbeddingOutput per input as each is pooled, then one Finished. Raises at once,
        queueing nothing, as submit() does. A request of more inputs than max_waiting is
        let in only when nothing waits, so it is never refused for good."""
        core = self._core()
        for ids in inputs:
            core.check_embedding(ids, pooling)
        if request_id in self._streams:
            raise RequestFailed(f"request id {request_id!r} is already running")
        self.check_room(min(len(inputs), self.max_waiting))
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(),
                         [f"{request_id}-{i}" for i in range(len(inputs))],
                         sum(len(ids) for ids in inputs), time.monotonic())
        self._streams[request_id] = stream
        self._inbox.append(("embed", (request_id, inputs, pooling, options)))
        self._wake.set()
        deadline = None if self.request_timeout_s is None else \
            time.monotonic() + self.request_timeout_s
        return RequestStream(self, request_id, stream, deadline)

    def check_room(self, num_sequences: int) -> None:
        """Raise Overloaded unless `num_sequences` more can wait (each of a request's n
        completions of each prompt is one sequence, and each input to embed) without
        passing max_waiting."""
        queued = self.stats.num_waiting + sum(len(p[2]) if kind == "add" else len(p[1])
                                              for kind, p in list(self._inbox)
                                              if kind in ("add", "embed"))
        if num_sequences > self.max_waiting:
            raise TooManySequences(f"the server takes at most {self.max_waiting} sequences "
                                   f"waiting and this request adds {num_sequences} (prompts x "
                                   "n); send fewer prompts or a smaller n, or raise the "
                                   "server's --max-waiting")
        if queued + num_sequences > self.max_waiting:
            raise Overloaded(f"the server has {queued} sequences waiting and takes at most "
                             f"{self.max_waiting}; this request adds {num_sequences}; "
                             "retry later")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       options: RequestOptions = RequestOptions()
                       ) -> AsyncIterator[CompletionOutput | Finished]:
        """submit() and iterate: deltas (one per sequence per step), then one Finished."""
        stream = self.submit(request_id, prompt_token_ids, params, options)
        try:
            async for item in stream:
                yield item
        finally:
            stream.close()

    def _release(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def _core(self) -> EngineCore:
        if self.state is EngineState.DEAD:
            raise EngineDead(f"the engine has stopped after an error ({self.error}); "
                             "restart the server")
        if self.core is None or self.state is EngineState.LOADING:
            raise EngineLoading("the model is still loading; retry in a few seconds")
        return self.core

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.process_s = process_age_s()   # the process's life before the engine loads
            self.core = (self.core_factory or EngineCore)(self.config)
            self._warm_up()
            self.core.advise_kv_huge_pages()
            self.core.load_phases.mark("warm_up")
            self.state = EngineState.READY
            self._publish_stats(stepped=False)
            self._loaded.set()
            worked = True  # since the engine was last idle (the warm-up counts)
            unfaulted = self.core.kv_pages_to_fault()
            if self.core.kv_connector is not None:
                self.core.kv_connector.on_ready = self._wake.set
            while self._handle_inbox():
                if self.core.move_kv():   # pins that ended, copies that arrived
                    self._publish_stats(stepped=False)
                if not self.core.has_unfinished():
                    if worked:  # a burst ended: its freed activations go back to the OS
                        return_free_memory()  # (~5 ms; a request arriving meanwhile waits)
                        worked = False
                    if next(unfaulted, False) is None:  # idle: one more KV huge page in
                        continue                        # (~1 ms), then the inbox again
                    self.core.check_alive()   # a rank of the model gone: the engine is dead
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    self._step()
                except StepFailed as failure:
                    self._isolate(failure)
                worked = True
                if self.core.idle_step:   # every request waits on a copy: until one ends
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - any crash ends the engine, loudly
            log.exception("engine loop crashed")
            self.error = e
            self.state = EngineState.DEAD
            for stream in list(self._streams.values()):
                stream.put(EngineDead(f"the engine stopped after an internal error ({e!r}); "
                                      "restart the server"))
        finally:
            if self.core is not None:
                self.core.close()   # the model's other ranks, if any, stop too
            self._loaded.set()

    def _warm_up(self) -> None:
        """One short generation (or embedding), so the first user does not pay for lazy
        initialisation."""
        if self.core.task == "embed":
            self.core.add_embedding("warmup", [0] * 16)
        else:
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            self.core.add_request("warmup", [0] * 16, params)
        while self.core.has_unfinished():
            self.core.step()

    def _handle_inbox(self) -> bool:
        """Apply queued adds and aborts. False when asked to stop."""
        if not self._inbox:
            return True
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "stop":
                return False
            if kind == "abort":
                self._abort(payload)
            elif kind == "embed":
                self._add_embedding(*payload)
            else:
                self._add(*payload)
        self._publish_stats(stepped=False)
        return True

    def _add(self, request_id: str, prompt_token_ids: list[int],
             children: list[SamplingParams], options: RequestOptions,
             grammar: object | None, export_kv: bool, remote: RemotePrefill | None) -> None:
        def add(seq_id: str, index: int) -> SequenceText:
            request = self.core.add_request(seq_id, prompt_token_ids, children[index], options,
                                            grammar, export_kv, remote)
            return SequenceText(self.core.tokenizer, request, index,
                                num_shown_elsewhere=len(request.output_token_ids))
        self._add_sequences(request_id, add)

    def _add_embedding(self, request_id: str, inputs: list[list[int]], pooling: PoolingParams,
                       options: RequestOptions) -> None:
        def add(seq_id: str, index: int) -> PooledSequence:
            return PooledSequence(self.core.add_embedding(seq_id, inputs[index], pooling,
                                                          options), index)
        self._add_sequences(request_id, add)

    def _add_sequences(self, request_id: str,
                       add: Callable[[str, int], SequenceText | PooledSequence]) -> None:
        """Queue a stream's sequences in the engine (`add` makes the one of each id and
        index); if one is refused, none stays queued."""
        stream = self._streams.get(request_id)
        if stream is None:  # cancelled before it reached the engine
            return
        try:
            for index, seq_id in enumerate(stream.sequences):
                self._texts[seq_id] = (request_id, add(seq_id, index))
                stream.num_open += 1
        except EmberError as e:
            self._abort(request_id)
            stream.put(e)
        except Exception as e:  # noqa: BLE001 - this request's fault, not the engine's
            log.error("request %s failed", request_id, exc_info=e)
            self.num_failed_requests += 1
            self._abort(request_id)
            stream.put(_failed(e))

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        seq_ids = stream.sequences if stream else [s for s, (r, _) in self._texts.items()
                                                   if r == request_id]
        for seq_id in seq_ids:
            self.core.finish(seq_id, FinishReason.ABORT)
            self._texts.pop(seq_id, None)

    def _isolate(self, failure: StepFailed) -> None:
        """Find the request that makes steps fail and fail it alone (see the module doc)."""
        log.warning("a step failed (%s); stepping its %d requests apart to find the cause",
                    failure, len(failure.request_ids))
        if not failure.request_ids:
            raise failure.error  # nothing was scheduled: the engine itself is broken
        pending = [failure.request_ids]
        while pending:
            group = [r for r in pending.pop() if r in self.core.scheduler.requests]
            if not group:
                continue
            try:
                self._step(only=frozenset(group))
            except StepFailed as again:
                if len(group) > 1:
                    half = len(group) // 2
                    pending += [group[half:], group[:half]]
                else:
                    self._fail(group[0], again.error)

    def _fail(self, seq_id: str, error: Exception) -> None:
        """End the request that sequence `seq_id` belongs to with RequestFailed."""
        log.error("request %s failed", seq_id, exc_info=error)
        self.num_failed_requests += 1
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
            raise RuntimeError(f"{self._failures_in_a_row} requests in a row failed with no "
                               f"good step between them; the last: {error!r}") from error
        entry = self._texts.get(seq_id)
        if entry is None:
            self.core.finish(seq_id, FinishReason.ABORT)
            return
        stream = self._streams.get(entry[0])
        self._abort(entry[0])
        if stream is not None:
            stream.put(_failed(error))

    def _step(self, only: frozenset[str] | None = None) -> None:
        """One engine step; its outputs reach the event loop in one call (one wake-up of the
        loop per step, not one per request: 26 a step at concurrency 32)."""
        advanced = self.core.step(only)
        if advanced:
            self._failures_in_a_row = 0
        outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}

        def put(stream: _Stream, item: Any) -> None:
            outbox.setdefault(stream.loop, []).append((stream.queue, item))

        for request in advanced:
            entry = self._texts.get(request.request_id)
            if entry is None:
                continue
            request_id, seq = entry
            stream = self._streams.get(request_id)
            try:
                export = self._export(request.request_id, seq)
                delta = seq.take_delta()
            except Exception as e:  # noqa: BLE001 - detokenizing one request failed
                self._fail(request.request_id, e)
                continue
            if stream is None:
                continue
            if stream.first_scheduled is None:
                stream.first_scheduled = request.first_scheduled_time
                stream.num_cached_tokens = request.num_cached_tokens
            stream.export = export or stream.export
            put(stream, delta)
            if seq.finish_reason is not None:
                del self._texts[request.request_id]
                stream.num_open -= 1
                if stream.num_open == 0:
                    queue_time = (stream.first_scheduled or stream.arrival_time) - \
                        stream.arrival_time
                    put(stream, Finished(stream.num_prompt_tokens, max(0.0, queue_time),
                                         stream.num_cached_tokens, stream.export))
                    put(stream, _STOP)
        for loop, items in outbox.items():
            loop.call_soon_threadsafe(_deliver, items)
        self._publish_stats(stepped=True)

    def _export(self, seq_id: str, seq: SequenceText) -> Export | None:
        """Take in a sequence's new tokens (a stop string ends it); the blocks its step kept
        for a decode replica, unless a stop string ended it (then they go back)."""
        export = self.core.exports.pop(seq_id, None) if self.core.kv_connector else None
        seq.continues_elsewhere = export is not None
        if seq.update():
            self.core.finish(seq_id, FinishReason.STOP)
            if export is not None:
                self.core.kv_connector.release(export.transfer_id, "stopped")
                export, seq.continues_elsewhere = None, False
        return export

    def _publish_stats(self, stepped: bool) -> None:
        scheduler, kv = self.core.scheduler, self.core.scheduler.kv
        self.stats = EngineStats(num_running=scheduler.num_running,
                                 num_waiting=scheduler.num_waiting,
                                 kv_cache_usage=kv.usage(),
                                 num_preemptions=scheduler.num_preemptions,
                                 num_steps=self.stats.num_steps + stepped,
                                 last_step_time=time.monotonic(),
                                 prefix_cache_queries=kv.num_queried_tokens,
                                 prefix_cache_hits=kv.num_hit_tokens,
                                 prefix_cache_evictions=kv.pool.num_evictions,
                                 num_cached_blocks=kv.pool.num_cached_blocks,
                                 spec_num_drafts=scheduler.spec_stats.num_drafts,
                                 spec_num_draft_tokens=scheduler.spec_stats.num_draft_tokens,
                                 spec_num_accepted_tokens=scheduler.spec_stats.num_accepted_tokens,
                                 kv_transfer=self.core.kv_connector.snapshot()
                                 if self.core.kv_connector is not None else None,
                                 pipeline_bubble=self._pipeline_bubble())

    def _pipeline_bubble(self) -> float | None:
        bubble = getattr(self.core.runner, "bubble", None)   # (an encoder's runner has none)
        return None if bubble is None or bubble.num_stages == 1 else bubble.share

    def kv_events_after(self, seq: int) -> tuple[list, bool]:
        """The prefix cache's stored/removed events after `seq` (any thread may ask)."""
        return self._core().scheduler.kv.pool.events_after(seq)

    def kv_snapshot(self) -> tuple[dict[int, tuple[int | None, int]], int]:
        """Every block the prefix cache holds now, and the event seq to continue after (any
        thread may ask)."""
        return self._core().scheduler.kv.pool.snapshot()

    # -- a prefill replica's pinned blocks (any thread: the connector locks) ----------------

    @property
    def role(self) -> str:
        return self.config.kv_transfer.role

    def kv_claim(self, transfer_id: str) -> dict | None:
        """Hold a pinned transfer for a pull; where its blocks are, or None if not pinned."""
        connector = self._core().kv_connector
        return connector.claim(transfer_id) if connector is not None else None

    def kv_read(self, transfer_id: str, block_ids: list[int]) -> Iterator[bytes] | None:
        """A pinned transfer's blocks as a byte stream, or None if not pinned or not its."""
        connector = self._core().kv_connector
        return connector.read(transfer_id, block_ids) if connector is not None else None

    def kv_release(self, transfer_id: str) -> bool:
        """Unpin a transfer; False if it was not pinned (never, or no longer)."""
        connector = self._core().kv_connector
        return connector.release(transfer_id) if connector is not None else False



def _failed(error: Exception) -> RequestFailed:
    return RequestFailed(f"the server failed while serving this request ({type(error).__name__}"
                         f": {error}); other requests were not affected; retry it, and report "
                         "it if it happens again")


class RequestStream:
    """One submitted request's results, as an async iterator. Closing it early aborts the
    request in the engine (its KV blocks are freed before the next step)."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream,
                 deadline: float | None) -> None:
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self._deadline = deadline
        self.finished = False
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> CompletionOutput | Finished:
        if self.closed:
            raise StopAsyncIteration
        try:
            item = await self._get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item is _STOP:
            self.finished = True
            self.close()
            raise StopAsyncIteration
        return item

    async def _get(self) -> object:
        queue = self._stream.queue
        if self._deadline is None or not queue.empty():
            return await queue.get()
        # a timeout scope, not wait_for, which wraps each get (one per token streamed) in a
        # task of its own: 15 -> 10 us of the event loop's CPU per item
        deadline = asyncio.get_running_loop().time() + self._deadline - time.monotonic()
        try:
            async with asyncio.timeout_at(deadline):
                return await queue.get()
        except TimeoutError:
            raise RequestTimeout(
                f"the request ran longer than the server's limit of "
                f"{self.engine.request_timeout_s:g} s; ask for fewer tokens") from None

    def close(self) -> None:
        """Stop listening; abort the request unless it finished. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self.engine._release(self.request_id, self.finished)
