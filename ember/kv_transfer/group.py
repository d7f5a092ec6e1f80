"""A replica's KV cache as a group of ranks' caches: which layers and KV heads each rank holds
(tensor parallel cuts the heads, pipeline parallel the layers), and how blocks move between
two groups of any sizes.

A one-process replica is a group of one part holding every layer and head. A model split over
ranks keeps each rank's cache in shared memory (shm.py); the driver maps them all, so the
driver alone reads (prefill) and writes (decode) the whole group's blocks, beside its engine,
as a one-process replica does its own: the block ids are the driver's scheduler's, the same
slots on every rank.

Between two groups of one layout (the same tensor and pipeline sizes) each rank's tensors
pair up whole. Otherwise every (layer, K or V, head range) that one source rank holds and one
destination rank needs becomes a piece: t[kv, first:end] of a [2, kv_heads, blocks, ...]
tensor, contiguous, viewed as [1, heads, blocks, ...] so that copy_blocks takes it as it takes
a whole tensor:

    prefill T=2 (heads 0-1 | 2)        decode T=1 (heads 0-2)
    rank 0: t[k, 0:2] ---------------> t[k, 0:2]
    rank 1: t[k, 0:1] ---------------> t[k, 2:3]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ember.kv_transfer.params import TransferFailed


@dataclass(frozen=True)
class RankPart:
    """The model's layers [first_layer, end_layer) and KV heads [first_head, end_head) one
    rank's cache holds."""

    first_layer: int
    end_layer: int
    first_head: int
    end_head: int

    def to_list(self) -> list[int]:
        return [self.first_layer, self.end_layer, self.first_head, self.end_head]

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


@dataclass(frozen=True)
class RankKV:
    """One rank's part and its cache tensors (cache_tensors order: layer by layer, data then
    scale)."""

    part: RankPart
    tensors: list[Tensor]

    def layer(self, index: int) -> list[Tensor]:
        """The tensors of the model's layer `index` (which this rank holds)."""
        per_layer = len(self.tensors) // self.part.num_layers
        start = (index - self.part.first_layer) * per_layer
        return self.tensors[start:start + per_layer]


def describe_parts(group: list[RankKV]) -> list[list[int]]:
    return [r.part.to_list() for r in group]


def parse_parts(parts: object) -> list[RankPart]:
    """A claim's `parts` (describe_parts); TransferFailed where it is not that."""
    try:
        out = [RankPart(*(int(x) for x in p)) for p in parts]
    except (TypeError, ValueError) as e:
        raise TransferFailed("incompatible", f"the claim's parts are malformed: {e}") from e
    if not out:
        raise TransferFailed("incompatible", "the claim names no ranks")
    return out


def describe_layout(parts: list[RankPart]) -> str:
    """'2 ranks: layers 0-30 heads 0-2 | ...', for messages."""
    return f"{len(parts)} rank(s): " + " | ".join(
        f"layers {p.first_layer}-{p.end_layer} heads {p.first_head}-{p.end_head}" for p in parts)


def unit_nbytes(group: list[RankKV]) -> int:
    """Bytes of one block of one KV head of one layer: two groups of one cache format agree
    on it, whatever their sizes."""
    first = group[0]
    return sum(t[:, :1, 0].numel() * t.element_size()
               for t in first.layer(first.part.first_layer))


def pair_pieces(src: list[RankKV], dst: list[RankKV]) -> tuple[list[Tensor], list[Tensor]]:
    """Source and destination tensors, paired in order, that together carry every head of
    every layer each destination rank holds (the module doc). TransferFailed
    ("incompatible") where a destination layer or head is held by no source rank."""
    if [r.part for r in src] == [r.part for r in dst]:
        return [t for r in src for t in r.tensors], [t for r in dst for t in r.tensors]
    src_out: list[Tensor] = []
    dst_out: list[Tensor] = []
    try:
        for target in dst:
            for layer in range(target.part.first_layer, target.part.end_layer):
                for a, b in _layer_pieces(src, target, layer):
                    src_out.append(a)
                    dst_out.append(b)
    except TransferFailed as e:
        detail = str(e).removeprefix("incompatible: ")
        raise TransferFailed("incompatible", f"{detail}; the prefill replica holds "
                             f"{describe_layout([r.part for r in src])}, this one "
                             f"{describe_layout([r.part for r in dst])}") from e
    return src_out, dst_out


def _layer_pieces(src: list[RankKV], target: RankKV, layer: int) -> list[tuple[Tensor, Tensor]]:
    """The pieces of one destination rank's layer: its heads, range by range from the
    source ranks that hold them."""
    pieces = []
    head, end = target.part.first_head, target.part.end_head
    while head < end:
        source = next((r for r in src if r.part.first_layer <= layer < r.part.end_layer
                       and r.part.first_head <= head < r.part.end_head), None)
        if source is None:
            raise TransferFailed("incompatible", f"no rank holds layer {layer}, KV head {head}")
        stop = min(end, source.part.end_head)
        for a, b in zip(source.layer(layer), target.layer(layer)):
            for kv in range(a.shape[0]):
                pieces.append((_heads(a, kv, head - source.part.first_head,
                                      stop - source.part.first_head),
                               _heads(b, kv, head - target.part.first_head,
                                      stop - target.part.first_head)))
        head = stop
    return pieces


def _heads(t: Tensor, kv: int, first: int, end: int) -> Tensor:
    """t[kv, first:end] of t [2, kv_heads, blocks, ...], as [1, end - first, blocks, ...]
    (contiguous: one K or V plane's heads are adjacent)."""
    return t[kv, first:end].unsqueeze(0)


def staging(src_parts: list[RankPart], like: list[RankKV], num_blocks: int) -> list[RankKV]:
    """Empty caches of `src_parts`' layout, `num_blocks` blocks each, in this replica's cache
    format (`like`'s tensors): where an HTTP stream of another layout lands before its
    pieces are copied into this replica's cache."""
    template = like[0].layer(like[0].part.first_layer)
    return [RankKV(p, [torch.empty((t.shape[0], p.end_head - p.first_head, num_blocks,
                                    *t.shape[3:]), dtype=t.dtype)
                       for _ in range(p.num_layers) for t in template])
            for p in src_parts]
