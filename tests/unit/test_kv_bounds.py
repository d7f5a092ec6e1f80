"""Bounded internal state in the KV layer: eviction structures under heavy reuse, KV events
for a repeated prompt (reference: a plain model of each policy, and the count of distinct
blocks the prompt fills)."""
from __future__ import annotations

import random

import pytest

from ember.config import SchedulerConfig
from ember.kv.block_pool import BlockPool
from ember.kv.kv_manager import BlockCopy, KVCacheManager
from ember.request import Request, SamplingParams
from ember.scheduler.output import RunnerOutput
from ember.scheduler.scheduler import Scheduler

EOS = 2

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


def run_prompt(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), frozenset({EOS}),
                      max_tokens)
    sched.add(request)
    for _ in range(200):
        if not sched.has_unfinished():
            return request
        plan = sched.schedule()
        out = RunnerOutput()
        for item in plan.scheduled:
            if item.samples:
                out.sampled_token_ids[item.request.request_id] = [7]
        sched.update(plan, out)
    raise AssertionError("the scheduler never drained")


@pytest.mark.parametrize("num_prompt_tokens,max_tokens", [(40, 1), (40, 8), (32, 1), (45, 3)])
def test_repeating_a_prompt_stores_its_blocks_once(num_prompt_tokens, max_tokens):
    """The first run stores one event per block it fills (whole, or the partial tail); every
    repeat reuses all but the last prompt token and stores or removes nothing."""
    block_size = 16
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                      KVCacheManager(32, block_size), max_model_len=4096)
    prompt = list(range(500, 500 + num_prompt_tokens))
    pool = sched.kv.pool
    run_prompt(sched, "first", prompt, max_tokens)
    computed = num_prompt_tokens + max_tokens - 1  # the last sampled token is never computed
    first, _ = pool.events_after(-1)
    assert [e.kind for e in first] == ["stored"] * -(-computed // block_size)
    for n in range(50):
        seq = pool.next_event_seq - 1
        request = run_prompt(sched, f"repeat{n}", prompt, max_tokens)
        assert request.num_cached_tokens == num_prompt_tokens - 1
        assert pool.events_after(seq) == ([], False)


def test_a_pool_that_cannot_spare_the_copy_source_still_admits_the_request():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=1), frozenset({EOS}), 1)
    hit = kv.find_prefix(a)
    assert kv.allocate_slots(a, a.num_tokens, hit)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    *full, tail = kv.block_table("a")
    kv.free(a)
    b = Request("b", list(range(10)) + [20, 21], SamplingParams(max_tokens=1), frozenset({EOS}), 1)
    hit = kv.find_prefix(b)
    assert (hit.partial_block, hit.partial_tokens) == (tail, 2)
    assert kv.allocate_slots(b, b.num_tokens, hit)      # every block: the source is taken
    assert kv.block_table("b") == full + [tail] and kv.pool.num_evictions == 1
    assert kv.take_copies() == [BlockCopy(tail, tail, 2)]
