"""Moving KV blocks between two caches of one layout (ember/kv_transfer/blocks.py): the
reference is plain indexing of the source block by block, for both the copy (few runs and
scattered blocks) and the byte stream, in bf16 and int8-with-scales layouts."""
from __future__ import annotations

import random

import pytest
import torch

from ember.kv_transfer.blocks import BlockWriter, copy_blocks, read_blocks, runs


def caches(num_blocks: int, int8: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = (2, 3, num_blocks, 4, 8)
    if int8:   # two layers: values, then their scales
        return [t for _ in range(2) for t in (
            torch.randint(-127, 128, data, generator=g, dtype=torch.int8),
            torch.rand(data[:-1], generator=g).to(torch.float16))]
    return [torch.randn(data, generator=g).to(torch.bfloat16) for _ in range(3)]


def test_runs_join_pairs_adjacent_on_both_sides():
    assert runs([(3, 10), (4, 11), (5, 13), (9, 14)]) == [(3, 10, 2), (5, 13, 1), (9, 14, 1)]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("scattered", [False, True])
def test_copy_and_stream_move_exactly_the_blocks(int8, scattered):
    rng = random.Random(int(int8) * 2 + int(scattered))
    src, dst = caches(40, int8, 1), caches(50, int8, 2)
    if scattered:
        pairs = list(zip(rng.sample(range(40), 20), rng.sample(range(50), 20)))
    else:
        pairs = [(5 + i, 30 + i) for i in range(10)] + [(20 + i, 2 + i) for i in range(7)]
    before = [t.clone() for t in dst]
    copy_blocks(src, dst, pairs)
    streamed = [t.clone() for t in before]
    writer = BlockWriter(streamed, [d for _, d in pairs])
    for chunk in read_blocks(src, [s for s, _ in pairs]):
        writer.write([chunk[:7], chunk[7:]])   # pieces need not fall on block bounds
    assert writer.complete
    want = [t.clone() for t in before]
    for s, d in pairs:
        for a, w in zip(src, want):
            w[:, :, d] = a[:, :, s]
    for got in (dst, streamed):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bytes_past_the_last_block_are_refused():
    src, dst = caches(4, False, 1), caches(4, False, 2)
    writer = BlockWriter(dst, [1])
    chunk = next(read_blocks(src, [0]))
    with pytest.raises(ValueError):
        writer.write([chunk + b"x"])
