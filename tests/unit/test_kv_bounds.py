"""Bounded internal state in the KV layer: eviction structures under heavy reuse, KV events
for a repeated prompt (reference: a plain model of each policy, and the count of distinct
blocks the prompt fills)."""
from __future__ import annotations

import random

import pytest

from ember.kv.block_pool import BlockPool

NUM_CACHED = 6


def reference_order(facts: dict[int, tuple[int, int, int]], policy: str) -> list[int]:
    """The eviction order each policy's rule gives for idle leaves with these
    (hits, depth, released) facts, all made candidates before the first eviction."""
    left = dict(facts)
    order: list[int] = []
    worth = {b: (h + 1) * (d + 1) for b, (h, d, _) in left.items()}  # L was 0 at insert
    while left:
        if policy == "lru":
            b = min(left, key=lambda b: left[b][2])
        elif policy == "lfu":
            b = min(left, key=lambda b: (left[b][0], left[b][2]))
        else:
            b = min(left, key=lambda b: (worth[b], left[b][2]))
        order.append(b)
        del left[b]
    return order


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_reusing_a_few_blocks_often_keeps_the_eviction_structure_small(policy):
    rng = random.Random(1)
    pool = BlockPool(NUM_CACHED, policy)
    blocks = pool.allocate(NUM_CACHED)
    for b in blocks:  # independent roots: every idle one is a leaf, a candidate
        pool.cache(b, key=1000 + b, parent_key=None, depth=b % 3, token_ids=[b])
    pool.free(blocks)
    hits = {b: 0 for b in blocks}
    released = {b: b + 1 for b in blocks}  # freed in table order: clock 1..NUM_CACHED
    clock = NUM_CACHED
    for _ in range(100_000):
        b = rng.choice(blocks[:3])  # a few hot blocks, the rest stay idle
        pool.touch([b])
        pool.free([b])
        hits[b] += 1
        clock += 1
        released[b] = clock
        idle = pool._idle
        size = len(idle._heap) if policy == "lru" else len(idle)
        assert size <= 2 * NUM_CACHED + 16
    facts = {b: (hits[b], b % 3, released[b]) for b in blocks}
    expected = reference_order(facts, policy)
    got = [pool.allocate(1)[0] for _ in blocks]
    assert got == expected
