"""Executors: where the ranks of one model run, and how each step reaches them.

    engine process (rank 0, the driver)             worker process (rank r)
    scheduler -> runner.forward(plan)               steps.receive() -> step
      peers.send(step)  --- broadcast (shm) ---->   runner.run_step(step)
      forward on rank 0's part  <-- all-reduces -->   forward on rank r's part
      logits (gathered here) -> sampler                (no logits, no sampling)

The driver alone schedules, keeps the prefix cache and samples. A step reaches the workers
as plain data (each request's block table and the token ids the step computes), from which
every rank builds the same input tensors itself. The engine core only holds an Executor:
SingleProcess runs today's one-process path; LocalProcesses starts the other ranks as local
processes (`--distributed-executor mp`), each pinned to its own CPUs; RayActors
(ember/distributed/ray_executor.py, `--distributed-executor ray`) as Ray actors in a
placement group, on one node or several. Both share WorkerRanks: the engine sees the same
connect, send, check_alive and shutdown whichever started the ranks.

Faults: a rank that dies closes its sockets, and the driver's next collective raises at
once; one that hangs makes it raise after collective_timeout_s. Either way the step raises
EngineDead (the engine's dead-engine path), and the other ranks, finding the driver gone,
exit. An idle engine checks its workers are alive (check_alive) between steps.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch

import ember
from ember.distributed.collectives import (HOST, GlooSteps, RankCollectives, ShmSteps,
                                           join_groups, open_store)
from ember.distributed.parallel import format_cpus
from ember.errors import ConfigError, EngineDead
from ember.request import PoolingParams
from ember.runner.runner import ForwardStep, ModelRunner
from ember.scheduler.output import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0   # a worker still loading its part after this is taken as hung
STOP_WAIT_S = 10.0        # how long a worker gets to exit after the driver's stop
# builds a worker rank's runner: (setup, rank, collectives) -> ModelRunner; a module-level
# function, so it reaches the worker process by name (ember/engine/tensor_parallel.py)
BuildRunner = Callable[[Any, int, RankCollectives], ModelRunner]


class Executor(Protocol):
    """The ranks one model runs on, as the engine core sees them."""

    world_size: int

    def check_alive(self) -> None:
        """Raise EngineDead if a rank has gone (between steps)."""

    def shutdown(self) -> None:
        """Stop the other ranks (if any) and release what the executor holds."""


class SingleProcess:
    """The whole model in the engine's process: the runner has no peers. `cpus` (a
    one-rank --cpu-bind) pins the process there until shutdown."""

    world_size = 1

    def __init__(self, cpus: tuple[int, ...] | None = None) -> None:
        self._saved_binding = None if cpus is None else pin_process(cpus)
        if cpus is not None:
            log.info("the model's one process runs on CPUs %s, %d torch threads",
                     format_cpus(cpus), len(cpus))

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._saved_binding is not None:
            restore_binding(self._saved_binding)
            self._saved_binding = None


@dataclass(frozen=True)
class WorkerPayload:
    """What a worker rank is started with (pickled on a process's stdin, or a Ray actor's
    call)."""

    rank: int
    world_size: int
    stage_size: int          # ranks per pipeline stage (tensor_parallel_size)
    store_host: str          # the driver's store, at store_host:port
    port: int
    cpus: tuple[int, ...]    # the CPUs to bind to; () binds none (Ray chose the node)
    num_threads: int         # torch threads
    vocab_widths: tuple[int, ...]
    build: BuildRunner
    setup: Any
    log_level: int
    all_reduce: str          # ParallelConfig.all_reduce
    timeout_s: float         # a collective's wait within a step


class WorkerRanks:
    """Ranks 1..N-1 started elsewhere, however an executor starts them; rank 0 is this
    process, whose runner gets this object as its peers. What every such executor does the
    same way lives here: the driver's rendezvous store, the wait for the workers to load
    (connect), each step's broadcast (send), and how a rank's failure ends the engine.
    Start order: __init__ (the subclass starts the workers loading their parts), the driver
    loads its own part (collectives bound later), then connect() once it has.

    A subclass sets `workers` and `_release` (kill what still runs: also a finalizer, so a
    driver dropped without shutdown() leaves nothing behind) and gives _exited and
    _wait_stopped."""

    logs = "its log above says why"   # where a worker's own report of a failure is

    def __init__(self, world_size: int, stage_size: int | None, vocab_widths: list[int],
                 timeout_s: float, all_reduce: str, host: str = HOST) -> None:
        self.world_size = world_size
        # ranks per pipeline stage (None: one stage of them all)
        self.stage_size = self.world_size if stage_size is None else stage_size
        self.timeout_s = timeout_s
        self.all_reduce_kind = all_reduce
        self.all_reduce: Any = None   # the bound one, closed at shutdown
        self.vocab_widths = vocab_widths
        self.collectives = RankCollectives()   # rank 0's, bound by connect()
        self.broken: str | None = None   # why the ranks are out of step, once they are
        self.steps: GlooSteps | ShmSteps | None = None   # the plans' way to the workers
        self.host = host              # where the workers reach this process
        self.store = open_store(self.world_size, timeout_s, host)

    def payload(self, rank: int, cpus: tuple[int, ...], num_threads: int, build: BuildRunner,
                setup: Any) -> WorkerPayload:
        """What worker `rank` starts from."""
        return WorkerPayload(rank, self.world_size, self.stage_size, self.host,
                             self.store.port, cpus, num_threads, tuple(self.vocab_widths),
                             build, setup, logging.getLogger().getEffectiveLevel(),
                             self.all_reduce_kind, self.timeout_s)

    def _exited(self, rank: int) -> str | None:
        """Why worker `rank` has ended ("rank 1 (pid 42) exited with code 1"), or None
        while it runs."""
        raise NotImplementedError

    def _wait_stopped(self, wait_s: float) -> None:
        """Give the workers, told to stop, up to `wait_s` to end (_release kills the rest)."""
        raise NotImplementedError

    def connect(self) -> None:
        """Wait for every worker to have loaded its part, then form the ranks' group and bind
        rank 0's collectives. A worker that fails to load fails the start with its error."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        pending = set(range(1, self.world_size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    error = self.store.get(f"error/{rank}").decode(errors="replace")
                    raise ConfigError(f"tensor-parallel rank {rank} failed to start: {error}")
                if self.store.check([f"ready/{rank}"]):
                    pending.discard(rank)
                elif (gone := self._exited(rank)) is not None:
                    raise ConfigError(f"tensor-parallel {gone} while loading; {self.logs}")
            if pending and time.monotonic() > deadline:
                raise ConfigError(f"tensor-parallel ranks {sorted(pending)} did not load in "
                                  f"{LOAD_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        self.steps, self.all_reduce = join_groups(
            self.store, 0, self.stage_size, self.world_size // self.stage_size,
            timedelta(seconds=self.timeout_s), self.all_reduce_kind, self.timeout_s,
            self.vocab_widths, self.collectives, self.host)
        if self.all_reduce is not None:
            log.info("tensor parallel: all-reduce over %s", self.all_reduce.kind)
        log.info("model parallel: steps' plans over %s", self.steps.kind)

    def kv_segments(self) -> list[dict]:
        """Where ranks 1..N-1 keep their KV caches in shared memory (published before they
        said ready: a prefill or decode replica's), rank by rank."""
        return [json.loads(self.store.get(f"kv/{rank}")) for rank in range(1, self.world_size)]

    def send(self, step: ForwardStep) -> None:
        if self.broken is not None:
            raise EngineDead(f"the engine's ranks are out of step ({self.broken}); restart "
                             "the server")
        self.steps.send(step_message(step))

    def failed(self, error: BaseException) -> EngineDead:
        gone = self._gone()
        self.broken = gone or (f"a collective failed: {error}; a rank may hang (the timeout "
                               f"is collective_timeout_s={self.timeout_s:g})")
        return EngineDead(f"tensor-parallel step failed: {self.broken}; restart the server")

    def check_alive(self) -> None:
        gone = self._gone()
        if gone is not None:
            self.broken = gone
            raise EngineDead(f"tensor-parallel {gone}; restart the server")

    def _gone(self) -> str | None:
        for rank in range(1, self.world_size):
            if (gone := self._exited(rank)) is not None:
                return gone
        return None

    def shutdown(self) -> None:
        """Tell the workers to stop (unless the ranks are out of step), wait for them, kill
        any that stays, and release what the executor holds."""
        if self.steps is not None and self.broken is None:
            try:
                self.steps.send(None)
            except RuntimeError as e:   # a worker already gone: it is killed below
                log.warning("tensor parallel: stopping the workers: %s", e)
        self._wait_stopped(STOP_WAIT_S if self.steps is not None else 0.0)
        self.broken = self.broken or "shut down"
        if self.steps is not None:
            self.steps.close()
        self.steps = None
        if self.all_reduce is not None:
            self.all_reduce.close()
        self._release()


class LocalProcesses(WorkerRanks):
    """Ranks 1..T-1 as local processes (`--distributed-executor mp`), each bound to its
    CPUs, as is this process (rank 0)."""

    def __init__(self, cpus: list[tuple[int, ...]], vocab_widths: list[int], timeout_s: float,
                 build: BuildRunner, setup: Any, all_reduce: str = "auto",
                 stage_size: int | None = None) -> None:
        super().__init__(len(cpus), stage_size, vocab_widths, timeout_s, all_reduce)
        self._saved_binding = pin_process(cpus[0])
        self.workers = [_spawn(self.payload(rank, cpus[rank], len(cpus[rank]), build, setup))
                        for rank in range(1, self.world_size)]
        # a driver that fails to start, or is dropped without shutdown(), kills its workers
        self._release = weakref.finalize(self, _release, self.workers, self._saved_binding)
        log.info("model parallel: %d ranks; rank 0 (this process) on CPUs %s, %s",
                 self.world_size, format_cpus(cpus[0]),
                 ", ".join(f"rank {r} (pid {p.pid}) on CPUs {format_cpus(cpus[r])}"
                           for r, p in enumerate(self.workers, start=1)))

    def _exited(self, rank: int) -> str | None:
        worker = self.workers[rank - 1]
        if worker.poll() is None:
            return None
        return f"rank {rank} (pid {worker.pid}) exited with code {worker.returncode}"

    def _wait_stopped(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        for worker in self.workers:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass   # killed by _release


def _release(workers: list[subprocess.Popen], saved: tuple[set[int], int] | None) -> None:
    """Kill the workers still running, and give this process its CPUs back."""
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    if saved is not None:
        restore_binding(saved)


def _spawn(payload: WorkerPayload) -> subprocess.Popen:
    """A worker process of this Python, importing ember from where this process does (not
    multiprocessing's spawn, which re-runs the main script of a caller without a
    __main__ guard)."""
    paths = [str(Path(ember.__file__).resolve().parent.parent)] + sys.path
    boot = (f"import sys; sys.path[:0] = {paths!r}; "
            "from ember.distributed.worker import main; main()")
    process = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE)
    process.stdin.write(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    process.stdin.close()
    return process


# -- a step as plain data -------------------------------------------------------------------

class TokenWindow:
    """Token ids [offset, offset + len(ids)) of a request, indexed by position as its
    all_token_ids are (a step reads only the positions it computes)."""

    def __init__(self, offset: int, ids: list[int]) -> None:
        self.offset, self.ids = offset, ids

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.ids[index.start - self.offset:index.stop - self.offset]
        return self.ids[index - self.offset]


@dataclass(frozen=True)
class RowRequest:
    """What the runner reads of a Request to build a step's inputs."""

    request_id: str
    num_prompt_tokens: int
    all_token_ids: TokenWindow
    pooling: PoolingParams | None = None
    lora: str | None = None
    share_key: int = 0


# A step on the wire: (method, rows, block copies, adapters), a row per scheduled request
# (its id, prompt length, the step's token ids, pooling, adapter, share key, start, new
# tokens, block table, whether it samples, drafts). Tuples of plain values pickle and load
# several times faster than the dataclasses, on ranks whose caches the forward has just
# flushed.
StepMessage = tuple[str, list[tuple], list, Any]


def step_message(step: ForwardStep) -> StepMessage:
    """What the driver sends of `step`: each Request cut down to the step's own token ids;
    its adapters as they are (whole: each rank cuts its part)."""
    plan = step.plan
    return step.method, [_row(item) for item in plan.scheduled], plan.block_copies, \
        step.adapters


def _row(item: ScheduledRequest) -> tuple:
    request = item.request
    end = item.end - len(item.draft_token_ids)   # the drafts travel in the item itself
    return (request.request_id, request.num_prompt_tokens,
            request.all_token_ids[item.start:end], request.pooling, request.lora,
            request.share_key, item.start, item.num_new_tokens, item.block_ids, item.samples,
            item.draft_token_ids)


def received_step(message: StepMessage) -> ForwardStep:
    """A worker's ForwardStep from the driver's step_message: each request a RowRequest."""
    method, rows, block_copies, adapters = message
    scheduled = [ScheduledRequest(RowRequest(request_id, num_prompt, TokenWindow(start, ids),
                                             pooling, lora, key),
                                  start, num_new, block_ids, samples, drafts)
                 for (request_id, num_prompt, ids, pooling, lora, key, start, num_new,
                      block_ids, samples, drafts) in rows]
    return ForwardStep(method, SchedulerOutput(scheduled, frozenset(), block_copies),
                       adapters)


# -- CPU binding ----------------------------------------------------------------------------

def pin_process(cpus: tuple[int, ...]) -> tuple[set[int], int] | None:
    """Run every thread of this process on `cpus`, with as many torch threads; returns what
    to restore (restore_binding), or None where the OS binds no threads (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        log.warning("tensor parallel: this OS binds no threads to CPUs; ranks run unpinned")
        return None
    saved = (os.sched_getaffinity(0), torch.get_num_threads())
    _set_affinity(set(cpus))
    torch.set_num_threads(len(cpus))
    return saved


def restore_binding(saved: tuple[set[int], int]) -> None:
    cpus, threads = saved
    _set_affinity(cpus)
    torch.set_num_threads(threads)


def _set_affinity(cpus: set[int]) -> None:
    """Every current thread of the process (threads made later inherit their maker's)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass   # a thread that has just ended
