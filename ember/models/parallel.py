"""The vocabulary-parallel ends of a tensor-parallel model: each rank holds a range of the
vocabulary's rows of the embedding and of the output projection (ember/distributed/).

The collectives arrive as plain functions, so the model never knows how ranks talk:

    AllReduce  x -> None: x becomes the sum over the ranks of their x, in place
    Gather     local logits [N, rows] -> the whole vocabulary's [N, vocab] on the driver
               rank, [N, 0] on the others
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

AllReduce = Callable[[Tensor], None]
Gather = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class HeadShare:
    """Where a tensor-parallel rank holds a KV head that another rank holds too (the KV
    heads do not divide among the ranks: 3 over 2, rank 0 holds 0-1 and rank 1 holds 1-2,
    each with those heads' query heads), only one of them attends each request over it; the
    other's output for that head's query heads is zeros, which the all-reduce after the o
    projection adds to the first's. The KV heads are the points [0, num_kv_heads) of a line
    that the ranks cut evenly (rank r: [r K / T, (r + 1) K / T)): a request whose prompt has
    share key u (ember/request.py) is attended over KV head j by the rank whose cut holds
    j + u / keys, so every rank reads about as much of the cache (a whole head and half of
    the shared one each, at 3 over 2), and a request's rank is a function of its prompt
    (the same answer whatever runs beside it). Every rank writes every head it holds."""

    rank: int
    world_size: int
    kv_first: int       # the rank's first KV head, of the whole model's
    kv_count: int       # how many it holds
    num_kv_heads: int   # the whole model's
    keys: int           # share keys are in [0, keys)

    def skip_bits(self, key: int) -> int:
        """Bit i set: this rank does not attend a request of share key `key` over its KV
        head i (the rank's own numbering)."""
        low = self.rank * self.num_kv_heads * self.keys
        high = low + self.num_kv_heads * self.keys
        bits = 0
        for i in range(self.kv_count):
            point = self.world_size * ((self.kv_first + i) * self.keys + key)
            if not low <= point < high:
                bits |= 1 << i
        return bits


def zero_skipped(out: Tensor, skip: Tensor, kv_heads: int) -> Tensor:
    """out [T, heads, d], in place, with the query heads of each row's skipped KV heads
    (skip [T] int64, bit h: KV head h; HeadShare.skip_bits) set to zeros: for the paths
    whose kernels attend every head."""
    bits = torch.arange(kv_heads, device=skip.device)
    skipped = ((skip[:, None] >> bits) & 1).bool()                       # [T, kv_heads]
    mask = skipped.repeat_interleave(out.shape[1] // kv_heads, dim=1)   # [T, heads]
    return out.masked_fill_(mask[:, :, None], 0)


@dataclass(frozen=True)
class StackAllReduce:
    """The shared-memory all-reduce as a tensor-parallel rank's compiled decode stack calls
    it itself, after each o and down projection: the same handle (and so the same sequence of
    calls) as the AllReduce the layers call, and its waits."""

    handle: Any        # the compiled ShmAllReduce (ember/kernels/cpu/shm_allreduce.cpp)
    timeout_s: float
    spin_us: float


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + num_rows) of the embedding (`inner`, any module mapping ids to
    vectors): an id outside them contributes zeros, and the all-reduce sums the one rank
    holding its row with zeros from the others (exact)."""

    def __init__(self, inner: nn.Module, start: int, num_rows: int,
                 all_reduce: AllReduce) -> None:
        super().__init__()
        self.inner, self.start, self.num_rows = inner, start, num_rows
        self.all_reduce = all_reduce

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] long -> [T, hidden]."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        x = self.inner(local.masked_fill(outside, 0))
        x = x.masked_fill(outside[:, None], 0).contiguous()
        self.all_reduce(x)
        return x


class GatheredHead(nn.Module):
    """The output projection's rows of this rank (`inner`: vocabulary rows `start` on, of
    rank `rank` of `ranks`), its logits gathered whole on the driver rank, or only each
    row's argmax where that is all the driver reads (argmax)."""

    def __init__(self, inner: nn.Module, gather: Gather, all_reduce: AllReduce, start: int,
                 rank: int, ranks: int) -> None:
        super().__init__()
        self.inner, self.gather, self.all_reduce = inner, gather, all_reduce
        self.start, self.rank, self.ranks = start, rank, ranks
        self.kernels: Any = None   # CpuKernels (LlamaForCausalLM.use_kernels): argmax_rows

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (driver) or [N, 0] (other ranks)."""
        return self.gather(self.inner(hidden).contiguous())

    def argmax(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> each row's argmax over the whole vocabulary [N] long, on
        every rank: logits.argmax(-1) of forward's logits, where only each rank's best
        value and token travel (8 bytes a row and rank, not 4 per vocabulary row)."""
        local = self.inner(hidden).float().contiguous()
        # (torch's argmax and max walk a row in a scalar loop: 4x the kernel's time)
        index = None if self.kernels is None else self.kernels.argmax_rows(local)
        best = argmax_columns(local, self.start, self.rank, self.ranks, index)
        self.all_reduce(best)
        return pick_argmax(best)


def argmax_columns(local: Tensor, start: int, rank: int, ranks: int,
                   index: Tensor | None = None) -> Tensor:
    """A rank's logits [N, rows] (vocabulary rows start on) -> [N, 2 ranks] float32 of zeros
    but for columns 2 rank and 2 rank + 1: each row's largest logit and its token id (ids
    below 2^24 are exact in float32). Summed over the ranks (zeros add exactly), every
    rank's best side by side, for pick_argmax. `index`: local.argmax(-1) if known."""
    if index is None:
        index = local.argmax(dim=-1)   # the first of equal maxima
    values = local.gather(1, index[:, None]).squeeze(1)
    best = local.new_zeros((local.shape[0], 2 * ranks))
    best[:, 2 * rank] = values
    best[:, 2 * rank + 1] = (index + start).float()
    return best


def pick_argmax(best: Tensor) -> Tensor:
    """Every rank's argmax_columns summed [N, 2 ranks] -> the token of each row's largest
    logit [N] long: of equal maxima the lowest rank's, whose tokens come first (so a tie
    goes to the lower id, as argmax over the whole row)."""
    winner = best[:, 0::2].argmax(dim=-1, keepdim=True)
    return best[:, 1::2].gather(1, winner).squeeze(1).long()


def reduce_(all_reduce: AllReduce | None, x: Tensor) -> Tensor:
    """x summed over the ranks in place where there are several (`all_reduce` set), as a
    row-parallel projection's partial sums need; x as it is otherwise."""
    if all_reduce is None:
        return x
    x = x.contiguous()
    all_reduce(x)
    return x



# -- pipeline stages ------------------------------------------------------------------------
#
# A stage hands the next one its residual stream (Llama's as two tensors, x and the residual,
# which the next norm adds, so that the sum rounds as in one process); the last stage's
# logits go to the driver (rank 0, on the first stage), which samples:
#
#   stage 0 (driver)            stage 1                 ...   stage P-1
#   embed, layers -> send  -->  receive, layers -> send  -->  receive, layers, norm, head
#   head: receive logits  <----------------------------------  send logits

Receive = Callable[[tuple[int, ...], torch.dtype], Tensor]   # (shape, dtype) -> tensor
Send = Callable[[Tensor], None]


@dataclass(frozen=True)
class StageLink:
    """How a pipeline stage's model gets its input (the stage before's output, unless it is
    the first) and hands its output on (unless it is the last); and how the last stage's
    final hidden states reach the driver where it pools them (embeddings)."""

    is_first: bool
    is_last: bool
    receive: Receive
    send: Send        # returns at once; the tensor must not change until finish()
    finish: Callable[[], None]   # wait for this step's sends to be taken
    send_final: Send | None = None        # the last stage's (its first rank sends)
    receive_final: Receive | None = None  # the driver's

    def final(self, hidden: Tensor) -> Tensor:
        """A forward's final hidden states [T, hidden] where the driver needs them: the
        last stage sends its own (float32, as pooling reads them) and the driver takes
        them in place of its stage's output (`hidden`, of the same shape); every other rank
        keeps `hidden`. Every rank calls it for the same forwards."""
        if self.is_last and self.send_final is not None:
            self.send_final(hidden.float().contiguous())
        elif self.receive_final is not None:
            return self.receive_final(tuple(hidden.shape), torch.float32)
        return hidden


class LogitsFromLastStage(nn.Module):
    """The driver's output projection when the last stage holds the real one: the logits it
    sends, in float32 (exact for the model's dtypes), back in the model's dtype."""

    def __init__(self, receive: Receive, vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.receive, self.vocab_size, self.dtype = receive, vocab_size, dtype

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] (its row count only) -> logits [N, vocab]."""
        return self.receive((hidden.shape[0], self.vocab_size), torch.float32).to(self.dtype)


class LogitsToDriver(nn.Module):
    """The last stage's output projection (`inner`, gathered over the stage's tensor-parallel
    ranks where there are several): the rank that holds the whole logits sends them to the
    driver; every rank of the stage returns none."""

    def __init__(self, inner: nn.Module, send: Send) -> None:
        super().__init__()
        self.inner, self.send = inner, send

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> [N, 0]."""
        logits = self.inner(hidden)
        if logits.shape[1]:
            self.send(logits.float().contiguous())
        return logits[:, :0]


class NoLogits(nn.Module):
    """A rank that neither computes nor samples logits: [N, 0]."""

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden.new_empty((hidden.shape[0], 0))
