"""The vocabulary-parallel ends of a tensor-parallel model: each rank holds a range of the
vocabulary's rows of the embedding and of the output projection (ember/distributed/).

The collectives arrive as plain functions, so the model never knows how ranks talk:

    AllReduce  x -> None: x becomes the sum over the ranks of their x, in place
    Gather     local logits [N, rows] -> the whole vocabulary's [N, vocab] on the driver
               rank, [N, 0] on the others
"""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

AllReduce = Callable[[Tensor], None]
Gather = Callable[[Tensor], Tensor]


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
    """The output projection's rows of this rank (`inner`), its logits gathered whole on the
    driver rank."""

    def __init__(self, inner: nn.Module, gather: Gather) -> None:
        super().__init__()
        self.inner, self.gather = inner, gather

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (driver) or [N, 0] (other ranks)."""
        return self.gather(self.inner(hidden).contiguous())


def reduce_(all_reduce: AllReduce | None, x: Tensor) -> Tensor:
    """x summed over the ranks in place where there are several (`all_reduce` set), as a
    row-parallel projection's partial sums need; x as it is otherwise."""
    if all_reduce is None:
        return x
    x = x.contiguous()
    all_reduce(x)
    return x

