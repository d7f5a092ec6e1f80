"""Moving KV blocks between replicas whose models are split over ranks differently
(ember/kv_transfer/group.py): each rank holds some layers (pipeline stages) and some KV heads
(tensor-parallel shards, replicated where ranks outnumber heads). The reference is one whole
cache: cut into any layout, moved (shared-memory copy or HTTP byte stream) into any other,
every destination rank's slots must hold exactly the whole cache's blocks for its layers and
heads, and no other slot may change."""
from __future__ import annotations

import random

import pytest
import torch

from ember.kernels import CpuKernels, build_cpu_ops
from ember.kv_transfer.blocks import copy_blocks, read_blocks
from ember.kv_transfer.connector import HttpTransport
from ember.kv_transfer.group import RankKV, RankPart, pair_pieces, unit_nbytes
from ember.kv_transfer.params import TransferFailed

NUM_LAYERS, NUM_HEADS, BLOCK, DIM = 4, 3, 4, 8

# layouts by (pipeline stages' layers, tensor-parallel head ranges), stage by stage
LAYOUTS = {
    "one": ([(0, 4)], [(0, 3)]),
    "T2": ([(0, 4)], [(0, 2), (2, 3)]),
    "T4-replicated": ([(0, 4)], [(0, 1), (0, 1), (1, 2), (2, 3)]),
    "P2": ([(0, 2), (2, 4)], [(0, 3)]),
    "T2xP2": ([(0, 3), (3, 4)], [(0, 2), (2, 3)]),
}


def whole_cache(num_blocks: int, int8: bool, seed: int) -> list[list[torch.Tensor]]:
    """Each layer's tensors [2, heads, blocks, block, dim] (and int8's scales)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_HEADS, num_blocks, BLOCK, DIM)
    if int8:
        return [[torch.randint(-127, 128, shape, generator=g, dtype=torch.int8),
                 torch.rand(shape[:-1], generator=g).to(torch.float16)]
                for _ in range(NUM_LAYERS)]
    return [[torch.randn(shape, generator=g).to(torch.bfloat16)] for _ in range(NUM_LAYERS)]


def cut(whole: list[list[torch.Tensor]], layout: str) -> list[RankKV]:
    """`whole` cut into `layout`'s ranks (copies, as each rank's own memory)."""
    stages, shards = LAYOUTS[layout]
    return [RankKV(RankPart(first, end, h0, h1),
                   [t[:, h0:h1].clone() for layer in whole[first:end] for t in layer])
            for first, end in stages for h0, h1 in shards]


def empty_like_group(group: list[RankKV]) -> list[RankKV]:
    return [RankKV(r.part, [torch.zeros_like(t) for t in r.tensors]) for r in group]


def expected(whole, before: list[RankKV], pairs) -> list[RankKV]:
    """`before` with each pair's destination block set from the whole cache's source block."""
    out = empty_like_group(before)
    for old, new in zip(before, out):
        for t, u in zip(old.tensors, new.tensors):
            u.copy_(t)
        for layer in range(old.part.first_layer, old.part.end_layer):
            for u, w in zip(new.layer(layer), whole[layer]):
                for s, d in pairs:
                    u[:, :, d] = w[:, old.part.first_head:old.part.end_head, s]
    return out


def assert_same(a: list[RankKV], b: list[RankKV]) -> None:
    for x, y in zip(a, b):
        for t, u in zip(x.tensors, y.tensors):
            assert torch.equal(t.view(torch.uint8), u.view(torch.uint8)), x.part


class Stream:
    """The prefill replica's HTTP stream of its group's blocks (what its server sends)."""

    def __init__(self, group: list[RankKV]) -> None:
        self.group = group

    def blocks(self, block_ids: list[int]):
        return read_blocks([t for r in self.group for t in r.tensors], block_ids)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("src_layout,dst_layout", [
    ("T2", "T2"), ("T2", "one"), ("one", "T2"), ("T2", "T4-replicated"),
    ("T4-replicated", "T2"), ("P2", "T2"), ("T2xP2", "one"), ("one", "T2xP2")])
def test_any_layout_pulls_into_any_other(src_layout, dst_layout, int8):
    rng = random.Random(hash((src_layout, dst_layout, int8)) % 1000)
    whole = whole_cache(12, int8, seed=1)
    src = cut(whole, src_layout)
    dst_before = cut(whole_cache(10, int8, seed=2), dst_layout)   # other data in every slot
    pairs = list(zip(rng.sample(range(12), 5), rng.sample(range(10), 5)))
    want = expected(whole, dst_before, pairs)
    assert unit_nbytes(src) == unit_nbytes(dst_before)

    by_copy = [RankKV(r.part, [t.clone() for t in r.tensors]) for r in dst_before]
    src_pieces, dst_pieces = pair_pieces(src, by_copy)
    copy_blocks(src_pieces, dst_pieces, pairs)
    assert_same(by_copy, want)

    by_stream = [RankKV(r.part, [t.clone() for t in r.tensors]) for r in dst_before]
    moved = HttpTransport(by_stream).pull(Stream(src), {}, [r.part for r in src], pairs,
                                          deadline=float("inf"))
    assert moved == len(pairs) * sum(t[:, :, 0].numel() * t.element_size()
                                     for r in src for t in r.tensors)
    assert_same(by_stream, want)


def test_a_head_no_source_rank_holds_is_incompatible():
    whole = whole_cache(4, False, seed=3)
    src = [r for r in cut(whole, "T2") if r.part.first_head == 0]   # heads 0-1 only
    layouts = r"^incompatible: no rank holds layer 0, KV head 2; the prefill replica holds " \
        r"1 rank\(s\): layers 0-4 heads 0-2, this one 1 rank\(s\): layers 0-4 heads 0-3$"
    with pytest.raises(TransferFailed, match=layouts) as failed:
        pair_pieces(src, cut(whole, "one"))
    assert failed.value.reason == "incompatible"


@pytest.mark.parametrize("src_layout,dst_layout", [("T2", "one"), ("one", "T4-replicated"),
                                                   ("T2xP2", "T2")])
def test_the_compiled_copy_moves_the_pieces_as_torch_does(src_layout, dst_layout):
    kernels = CpuKernels(build_cpu_ops())   # a failed build is a failure here, not a skip
    whole = whole_cache(12, True, seed=4)
    src = cut(whole, src_layout)
    before = cut(whole_cache(10, True, seed=5), dst_layout)
    pairs = [(3, 0), (4, 1), (5, 2), (11, 7), (0, 9)]
    got = [RankKV(r.part, [t.clone() for t in r.tensors]) for r in before]
    copy_blocks(*pair_pieces(src, got), pairs, kernels)
    assert_same(got, expected(whole, before, pairs))
