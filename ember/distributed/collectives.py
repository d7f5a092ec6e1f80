"""How the ranks of one model talk: a gloo process group of their own (torch.distributed's
ProcessGroupGloo, never the process-wide default group, so that a process may hold several
engines), the all-reduce and logits gather the model calls, and each step's plan broadcast
from the driver.

The all-reduce comes from ember/distributed/allreduce.py (shared memory on one host, else
gloo; both add in rank order, so the result does not depend on the transport). The plans
take the same way: through the shared-memory segment where the ranks share a host, else a
gloo broadcast.
"""
from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember.distributed.allreduce import AllReduceFn, ShmAllReduce, make_all_reduce

HOST = "127.0.0.1"   # mp ranks share a host; Ray's ranks use their nodes' addresses
# a worker waits this long for the next step: an idle engine is not a failed one
IDLE_WAIT = timedelta(days=365)
HEADER_BYTES = 8
STEP_BUFFER_BYTES = 1 << 16   # a step's plan fits one gloo broadcast up to this size
STEP_SLOT_BYTES = 1 << 16     # a pipeline's plan segment: a larger plan goes in chunks
STEP_SPIN_US = 1000.0         # a worker spins this long for its next step, then sleeps


def open_store(world_size: int, timeout_s: float, host: str = HOST) -> dist.TCPStore:
    """The driver's rendezvous store, on a free port (store.port) of `host` (this machine's
    address the workers reach it at) for the workers to join."""
    return dist.TCPStore(host, 0, world_size, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float,
               host: str = HOST) -> dist.TCPStore:
    """The driver's store, at `host`:`port`."""
    return dist.TCPStore(host, port, world_size, False, timeout=timedelta(seconds=timeout_s))


def connect(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
            prefix: str = "tp", host: str = HOST) -> dist.ProcessGroup:
    """The ranks' gloo group, this rank listening at `host` (loopback where every rank is on
    this machine; every rank calls it; it returns once all have). A collective that waits
    on a rank longer than `timeout` raises. `prefix` names the group in the store: every
    member passes the same one (one per pipeline stage)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)


def join_groups(store: dist.Store, rank: int, stage_size: int, num_stages: int,
                timeout: timedelta, all_reduce: str, all_reduce_timeout_s: float,
                vocab_widths: list[int], collectives: RankCollectives, host: str = HOST
                ) -> tuple[GlooSteps | ShmSteps, Any]:
    """Every rank calls it, once its part of the model is built: the group of all ranks
    (stage by stage, `stage_size` ranks each), then, with tensor parallel, its stage's group
    for the all-reduce and the logits gather (the group of all ranks itself where there is
    one stage), bound into `collectives` with the pipeline's sends. Returns the channel of
    the steps' plans (step_channel) and the all-reduce (to close), or None. `host`: this
    rank's address the others reach it at."""
    world_size = stage_size * num_stages
    world = connect(store, rank, world_size, timeout, host=host)
    reduce = None
    if stage_size > 1:
        stage, local = divmod(rank, stage_size)
        group = world if num_stages == 1 else \
            connect(store, local, stage_size, timeout, prefix=f"stage{stage}", host=host)
        reduce = make_all_reduce(group, local, stage_size, all_reduce,
                                 timeout_s=all_reduce_timeout_s)
        gather = gather_through_shm(reduce, local, vocab_widths) if reduce.kind == "shm" \
            else gather_logits(group, local, vocab_widths)
        collectives.bind(reduce, gather, all_reduce_max(group))
    if num_stages > 1:
        collectives.bind_pipeline(StagePipe(world, rank, stage_size, num_stages))
    steps = step_channel(world, rank, world_size, reduce if num_stages == 1 else None,
                         all_reduce, all_reduce_timeout_s)
    return steps, reduce


def step_channel(world: dist.ProcessGroup, rank: int, world_size: int, reduce: Any,
                 kind: str, timeout_s: float) -> GlooSteps | ShmSteps:
    """How each step's plan goes from the driver to every rank: through shared memory where
    the ranks' all-reduce does (`reduce`, the all-reduce of every rank, shares its segment)
    or, on a pipeline, where a segment of all ranks opens (the same rule: one host, kind not
    gloo); else a broadcast over the group of all ranks `world`. Collective."""
    if reduce is not None:
        return ShmSteps(reduce.handle, timeout_s, owned=False) if reduce.kind == "shm" \
            else GlooSteps(world)
    if kind != "gloo":
        channel = make_all_reduce(world, rank, world_size, "auto", slot_bytes=STEP_SLOT_BYTES,
                                  timeout_s=timeout_s)
        if channel.kind == "shm":
            return ShmSteps(channel.handle, timeout_s, owned=True)
    return GlooSteps(world)


def gather_logits(group: dist.ProcessGroup, rank: int, widths: list[int]
                  ) -> Callable[[Tensor], Tensor]:
    """A Gather over `group`: each rank's logits [N, widths[rank]] (its vocabulary rows),
    padded to the widest, end up side by side on rank 0 as [N, sum(widths)]; the other
    ranks get [N, 0]."""
    widest = max(widths)

    def gather(local: Tensor) -> Tensor:
        rows = local.shape[0]
        padded = local if local.shape[1] == widest else \
            torch.nn.functional.pad(local, (0, widest - local.shape[1]))
        parts = [torch.empty_like(padded) for _ in widths] if rank == 0 else []
        group.gather([parts] if rank == 0 else [], [padded.contiguous()],
                     _gather_options(0)).wait()
        if rank != 0:
            return local.new_empty((rows, 0))
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)
    return gather


def gather_through_shm(reduce: ShmAllReduce, rank: int, widths: list[int]
                       ) -> Callable[[Tensor], Tensor]:
    """A Gather through the shared-memory segment of `reduce`: each rank's logits [N,
    widths[rank]] side by side on rank 0 as [N, sum(widths)] ([N, 0] on the others), copied
    as they are (no zeros added, and the other ranks need not wait for rank 0); by the
    all-reduce (gather_by_all_reduce) where a row of the widest does not fit a slot."""
    widest = max(widths)
    if widest * 4 > reduce.slot_bytes:   # float32 logits
        return gather_by_all_reduce(reduce, rank, widths)
    handle, timeout_s, spin_us = reduce.handle, reduce.timeout_s, reduce.spin_us
    total = sum(widths)
    nothing = torch.empty((0, 0))

    def gather(local: Tensor) -> Tensor:
        local = local.contiguous()
        out = local.new_empty((local.shape[0], total)) if rank == 0 else nothing
        handle.gather(local, out, widest, timeout_s, spin_us)
        return out if rank == 0 else local.new_empty((local.shape[0], 0))
    return gather


def gather_by_all_reduce(all_reduce: AllReduceFn, rank: int, widths: list[int]
                         ) -> Callable[[Tensor], Tensor]:
    """A Gather through the shared-memory all-reduce (a decode step's gather over gloo cost
    as much as the rest of the step on two busy cores): each rank's logits [N, widths[rank]]
    at its columns of zeros [N, sum(widths)], summed; adding zeros is exact (but for -0.0,
    which becomes +0.0), so rank 0 gets every rank's logits as they were ([N, 0] on the
    others). Logits of a dtype the all-reduce does not take go as float32, then back."""
    start = sum(widths[:rank])

    def gather(local: Tensor) -> Tensor:
        rows, dtype = local.shape[0], local.dtype
        wide = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        whole = torch.zeros((rows, sum(widths)), dtype=wide)
        whole[:, start:start + local.shape[1]] = local
        all_reduce(whole)
        return whole.to(dtype) if rank == 0 else local.new_empty((rows, 0))
    return gather


def all_reduce_max(group: dist.ProcessGroup) -> Callable[[Tensor], None]:
    """x -> None, in place: x becomes the elementwise max of every rank's x over `group`
    (exact in any order). For start-up only (the calibration's weight maxima): a gloo
    collective."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX

    def reduce(x: Tensor) -> None:
        group.allreduce([x], options).wait()
    return reduce


def _gather_options(root: int) -> dist.GatherOptions:
    options = dist.GatherOptions()
    options.rootRank = root
    return options


def broadcast_object(group: dist.ProcessGroup, obj: Any) -> None:
    """Send `obj` (pickled) from rank 0 to every other rank's receive_object: one broadcast
    of STEP_BUFFER_BYTES, a second for the rest of a bigger one."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buffer = torch.zeros(STEP_BUFFER_BYTES, dtype=torch.uint8)
    head = HEADER_BYTES + len(data)
    buffer[:HEADER_BYTES] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    first = min(len(data), STEP_BUFFER_BYTES - HEADER_BYTES)
    buffer[HEADER_BYTES:HEADER_BYTES + first] = torch.frombuffer(bytearray(data[:first]),
                                                                 dtype=torch.uint8)
    group.broadcast(buffer, 0).wait()
    if head > STEP_BUFFER_BYTES:
        rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
        group.broadcast(rest, 0).wait()


def receive_object(group: dist.ProcessGroup, timeout: timedelta = IDLE_WAIT) -> Any:
    """The next object rank 0 broadcasts, waiting up to `timeout` for it to start."""
    buffer = torch.empty(STEP_BUFFER_BYTES, dtype=torch.uint8)
    group.broadcast(buffer, 0, timeout).wait()
    size = int(buffer[:HEADER_BYTES].view(torch.int64)[0])
    first = min(size, STEP_BUFFER_BYTES - HEADER_BYTES)
    data = buffer[HEADER_BYTES:HEADER_BYTES + first].numpy().tobytes()
    if first < size:
        rest = torch.empty(size - first, dtype=torch.uint8)
        group.broadcast(rest, 0).wait()
        data += rest.numpy().tobytes()
    return pickle.loads(data)


class GlooSteps:
    """The steps' plans over the ranks' gloo group (ranks on several hosts)."""

    kind = "gloo"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, obj: Any) -> None:
        """`obj` to every other rank's receive() (rank 0)."""
        broadcast_object(self.group, obj)

    def receive(self) -> Any:
        """The next object rank 0 sends, however long the driver idles first."""
        return receive_object(self.group)

    def close(self) -> None:
        """Nothing to release: the group is the executor's."""


class ShmSteps:
    """The steps' plans through a shared-memory segment of every rank (its broadcast): rank
    0 hands a step over in microseconds, not a gloo receiver's wake-up. A waiting worker
    spins STEP_SPIN_US, then sleeps until the plan comes, however long the driver idles; it
    still raises within ~10 ms of the driver exiting or closing the segment."""

    kind = "shm"

    def __init__(self, handle: Any, timeout_s: float, owned: bool) -> None:
        self.handle, self.timeout_s, self.owned = handle, timeout_s, owned
        self._nothing = torch.empty(0, dtype=torch.uint8)

    def send(self, obj: Any) -> None:
        data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self.handle.broadcast(torch.frombuffer(data, dtype=torch.uint8), self.timeout_s,
                              STEP_SPIN_US)

    def receive(self) -> Any:
        return pickle.loads(self.handle.broadcast(self._nothing, math.inf,
                                                  STEP_SPIN_US).numpy())

    def close(self) -> None:
        """Leave the segment if it is the channel's own (else its all-reduce's owner does)."""
        if self.owned:
            self.handle.close()


ACTIVATIONS_TAG = 1   # stage -> next stage
LOGITS_TAG = 2        # last stage -> driver
FINAL_TAG = 3         # last stage -> driver: final hidden states to pool


class StagePipe:
    """Point-to-point sends between pipeline stages over the group of all ranks (ranks
    numbered stage by stage, `stage_size` per stage): a rank talks to the rank of the same
    place in the next stage, and the last stage's first rank sends logits to rank 0. Every
    shape is known to both ends from the step, so only the data travels."""

    def __init__(self, group: dist.ProcessGroup, rank: int, stage_size: int,
                 num_stages: int) -> None:
        self.group, self.rank, self.stage_size = group, rank, stage_size
        self.last_stage_rank = (num_stages - 1) * stage_size
        # sends not yet taken, each with its tensor (which must live until then): a stage
        # goes on to its next micro-batch while the next stage still receives this one
        self.pending: list[tuple[dist.Work, Tensor]] = []

    def send_next(self, x: Tensor) -> None:
        x = x.contiguous()
        self.pending.append((self.group.send([x], self.rank + self.stage_size,
                                             ACTIVATIONS_TAG), x))

    def receive_previous(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        self.group.recv([buffer], self.rank - self.stage_size, ACTIVATIONS_TAG).wait()
        return buffer

    def send_logits(self, logits: Tensor) -> None:
        self.pending.append((self.group.send([logits], 0, LOGITS_TAG), logits))

    def send_final(self, hidden: Tensor) -> None:
        """The last stage's final hidden states to the driver, from the stage's first rank
        (every rank of the stage holds them whole)."""
        if self.rank == self.last_stage_rank:
            self.pending.append((self.group.send([hidden], 0, FINAL_TAG), hidden))

    def receive_final(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        self.group.recv([buffer], self.last_stage_rank, FINAL_TAG).wait()
        return buffer

    def finish(self) -> None:
        """Wait for every send so far to be taken (at the end of each step)."""
        pending, self.pending = self.pending, []
        for work, _ in pending:
            work.wait()

    def receive_logits(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        self.group.recv([buffer], self.last_stage_rank, LOGITS_TAG).wait()
        return buffer


class RankCollectives:
    """A rank's collectives, bound once its group exists (the model is built before): the
    model holds these methods, which call whatever `bind` gave."""

    def __init__(self) -> None:
        self._all_reduce: AllReduceFn | None = None
        self._gather: Callable[[Tensor], Tensor] | None = None
        self._max: Callable[[Tensor], None] | None = None
        self._pipe: StagePipe | None = None
        self._on_bind: list[Callable[[AllReduceFn], None]] = []

    def bind(self, all_reduce: AllReduceFn, gather: Callable[[Tensor], Tensor],
             maximum: Callable[[Tensor], None] | None = None) -> None:
        self._all_reduce, self._gather, self._max = all_reduce, gather, maximum
        for call in self._on_bind:
            call(all_reduce)

    def when_bound(self, call: Callable[[AllReduceFn], None]) -> None:
        """Have bind() call `call` with the all-reduce (the model, built before its group
        exists, may then hand a shared-memory one to its compiled decode stack)."""
        self._on_bind.append(call)

    def bind_pipeline(self, pipe: StagePipe) -> None:
        self._pipe = pipe

    def _stage_pipe(self) -> StagePipe:
        if self._pipe is None:
            raise RuntimeError("a pipeline stage ran its model before joining its group")
        return self._pipe

    def send_next(self, x: Tensor) -> None:
        self._stage_pipe().send_next(x)

    def receive_previous(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return self._stage_pipe().receive_previous(shape, dtype)

    def send_logits(self, logits: Tensor) -> None:
        self._stage_pipe().send_logits(logits)

    def finish_sends(self) -> None:
        self._stage_pipe().finish()

    def send_final(self, hidden: Tensor) -> None:
        self._stage_pipe().send_final(hidden)

    def receive_final(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return self._stage_pipe().receive_final(shape, dtype)

    def receive_logits(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return self._stage_pipe().receive_logits(shape, dtype)

    def all_reduce(self, x: Tensor) -> None:
        if self._all_reduce is None:
            raise RuntimeError("a tensor-parallel rank ran its model before joining its group")
        self._all_reduce(x)

    def all_reduce_max(self, x: Tensor) -> None:
        """x, in place, the elementwise max over the rank's tensor-parallel group."""
        if self._max is None:
            raise RuntimeError("a tensor-parallel rank calibrated before joining its group")
        self._max(x)

    def gather(self, logits: Tensor) -> Tensor:
        if self._gather is None:
            raise RuntimeError("a tensor-parallel rank ran its model before joining its group")
        return self._gather(logits)
