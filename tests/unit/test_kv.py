"""Block pool, eviction policies and per-request block tables with the prefix cache: exact
block ids, hits, misses and eviction order (reference: the rules written in each module)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ember.kv.block_pool import BlockPool
from ember.kv.kv_manager import BlockCopy, KVCacheManager, PrefixHit
from ember.kv.prefix_cache import block_key, extend_keys
from ember.request import Request, SamplingParams


def test_pool_hands_out_blocks_in_order_and_reuses_the_oldest_freed_first():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([3, 1])
    assert pool.num_free_blocks == 3
    assert pool.allocate(2) == [3, 5]  # 5 (never used) and 3 (freed before 1), ascending
    assert pool.allocate(1) == [1]
    assert pool.usage() == 1.0


def test_a_growing_request_takes_the_blocks_after_its_last_while_they_are_empty():
    pool = BlockPool(8)
    assert pool.allocate(2) == [0, 1] and pool.allocate(2) == [2, 3]
    assert pool.allocate(2, after=3) == [4, 5]      # right after 3
    assert pool.allocate(2, after=1) == [6, 7]      # 2 is in use: the oldest empty blocks
    pool.free([5, 4])
    assert pool.allocate(2, after=7) == [4, 5]      # no block after 7: oldest freed, ascending
    pool.free([0])
    assert pool.allocate(1) == [0] and pool.num_free_blocks == 0


def test_a_growing_request_evicts_an_idle_cached_leaf_after_it_but_not_a_parked_parent():
    pool = BlockPool(8)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.cache(1, key=11, parent_key=None, depth=0, token_ids=range(16))
    pool.cache(2, key=12, parent_key=11, depth=1, token_ids=range(16))
    pool.free([2, 1])  # 2: an idle cached leaf; 1: its parent, parked while 2 is cached
    assert pool.allocate(1, after=0) == [4]         # 1 is parked: not taken out of turn
    assert pool.allocate(2, after=1) == [2, 5]      # 2 is evicted; 3 is in use
    assert pool.lookup(12) is None and pool.lookup(11) == 1 and pool.num_evictions == 1
    assert pool.allocate(1, after=0) == [1]         # 1 is a leaf now
    assert pool.lookup(11) is None and pool.num_evictions == 2
    events, _ = pool.events_after(-1)
    assert [(e.kind, e.block_key) for e in events][-2:] == [("removed", 12), ("removed", 11)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_random_traffic_never_hands_out_a_block_twice(policy):
    """Requests arrive (with room), grow (after their last block), cache their blocks as
    chains and finish, at random: every block handed out was free, and the free count is
    the blocks nobody holds."""
    rng = random.Random(0)
    pool = BlockPool(40, policy)
    tables: dict[int, list[int]] = {}
    key = 0
    for step in range(3000):
        held = {b for table in tables.values() for b in table}
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks >= 3:            # a new request
            n = rng.randint(1, 3)
            blocks = pool.allocate(n, room=rng.randint(0, 4))
            assert blocks == sorted(blocks) and not held & set(blocks)
            tables[step] = blocks
        elif op < 0.75 and tables and pool.num_free_blocks:    # one grows
            rid = rng.choice(list(tables))
            [b] = pool.allocate(1, after=tables[rid][-1])
            assert b not in held
            tables[rid].append(b)
        elif op < 0.85 and tables:                              # one caches its blocks
            table = tables[rng.choice(list(tables))]
            parent = None
            for depth, b in enumerate(table):
                key += 1
                pool.cache(b, key, parent, depth, range(4))
                parent = pool._meta[b].key
        elif tables:                                            # one finishes
            pool.free(tables.pop(rng.choice(list(tables)))[::-1])
        held = {b for table in tables.values() for b in table}
        assert all(pool.ref_count(b) == 1 for b in held)
        assert pool.num_free_blocks == pool.num_blocks - len(held)


def cached_pool(policy: str, depths: list[int]) -> tuple[BlockPool, list[int]]:
    """A pool of len(depths) + 1 blocks: each but the last cached (key 100 + i), then freed in
    order (block 0 released first)."""
    pool = BlockPool(len(depths) + 1, policy)
    blocks = pool.allocate(len(depths))
    for i, (b, depth) in enumerate(zip(blocks, depths)):
        pool.cache(b, 100 + i, None, depth, range(16))
    for b in blocks:
        pool.free([b])
    return pool, blocks


def evict_order(pool: BlockPool, n: int) -> list[int]:
    assert pool.allocate(1) == [n]  # the one empty block goes first
    return [pool.allocate(1)[0] for _ in range(n)]


def reuse(pool: BlockPool, block_id: int, times: int) -> None:
    for _ in range(times):
        pool.touch([block_id])
        pool.free([block_id])


def test_lru_evicts_the_least_recently_released():
    pool, blocks = cached_pool("lru", [0, 1, 2])
    reuse(pool, blocks[0], 1)  # block 0 is now the most recently released
    assert evict_order(pool, 3) == [blocks[1], blocks[2], blocks[0]]
    assert pool.num_evictions == 3 and pool.num_cached_blocks == 0


def test_lfu_evicts_the_least_reused_then_the_oldest():
    pool, blocks = cached_pool("lfu", [0, 1, 2])
    reuse(pool, blocks[0], 2)
    reuse(pool, blocks[2], 1)
    assert evict_order(pool, 3) == [blocks[1], blocks[2], blocks[0]]


def test_cost_policy_keeps_expensive_prefixes_and_ages_out_old_ones():
    # worth = L + (hits + 1) * (depth + 1): blocks at depth 0, 3, 1 are worth 1, 4, 2
    pool, blocks = cached_pool("cost", [0, 3, 1])
    assert pool.allocate(1) == [3]  # the empty block
    assert pool.allocate(1) == [blocks[0]]       # worth 1; L becomes 1
    pool.free([blocks[0]])                        # uncached now: it goes back as empty
    [a] = pool.allocate(1)
    pool.cache(a, 200, None, 0, range(16))
    pool.free([a])                                # worth 1 + 1 * 1 = 2, released last
    # blocks[2] (worth 2, released earlier) ties with a (worth 2): the older release goes
    assert [pool.allocate(1)[0] for _ in range(3)] == [blocks[2], a, blocks[1]]


def test_events_log_stored_and_removed_keys_in_order():
    pool = BlockPool(1, max_events=3)
    [a] = pool.allocate(1)
    pool.cache(a, 11, None, 0, range(16))
    pool.free([a])
    [b] = pool.allocate(1)                        # evicts key 11
    pool.cache(b, 12, 11, 1, range(16))
    events, dropped = pool.events_after(-1)
    assert [(e.seq, e.kind, e.block_key) for e in events] == [
        (0, "stored", 11), (1, "removed", 11), (2, "stored", 12)]
    assert events[2].parent_key == 11 and not dropped
    pool.free([b])
    pool.allocate(1)                              # a 4th event pushes the first out
    events, dropped = pool.events_after(-1)
    assert [e.seq for e in events] == [1, 2, 3] and dropped
    assert pool.events_after(2) == ([events[-1]], False)


def _replay(held: set[int], events) -> set[int]:
    """`held` with `events` applied in order: a stored key is held, a removed one is not."""
    out = set(held)
    for e in events:
        (out.add if e.kind == "stored" else out.discard)(e.block_key)
    return out


def test_a_snapshot_and_the_events_after_its_cursor_give_the_cache_at_any_later_time():
    """Reference: every event since the start replayed onto nothing. From any snapshot, its
    events replayed give the same keys; so they do from a copy taken later than its cursor
    was read (the engine thread logged in between), and each block keeps its stored
    event's parent and token count."""
    rng = random.Random(3)
    pool = BlockPool(6, max_events=10_000)
    snapshots = []
    for step in range(400):
        [block] = pool.allocate(1)               # evicts an idle cached block when full
        parent = rng.choice([None, *pool.snapshot()[0]])
        pool.cache(block, key=1000 + step, parent_key=parent, depth=0,
                   token_ids=range(rng.randint(1, 16)))
        pool.free([block])
        snapshots.append(pool.snapshot())
    every, _ = pool.events_after(-1)
    now = _replay(set(), every)
    assert len(now) == pool.num_cached_blocks
    for i, (held, cursor) in enumerate(snapshots):
        assert _replay(set(held), pool.events_after(cursor)[0]) == now
        later, _ = snapshots[min(i + 3, len(snapshots) - 1)]
        assert _replay(set(later), pool.events_after(cursor)[0]) == now
    held, cursor = pool.snapshot()
    assert cursor == every[-1].seq and set(held) == now
    stored = {e.block_key: (e.parent_key, e.num_tokens) for e in every if e.kind == "stored"}
    assert held == {key: stored[key] for key in now}


def make_request(rid: str, tokens: list[int], salt: str | None = None,
                 prefix_cache: bool = True) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), frozenset({2}), 8,
                   cache_salt=salt, prefix_cache=prefix_cache)


def run_prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit like the scheduler does: reuse hits, allocate the rest, compute, cache."""
    hit = kv.find_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit.blocks


def test_a_shared_prefix_is_reused_in_whole_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))             # blocks [0-3] [4-7] [8, 9]
    assert run_prefill(kv, a) == []
    assert kv.pool.num_cached_blocks == 2              # the partial third block is not cached
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits = run_prefill(kv, b)
    assert hits == kv.block_table("a")[:2] and kv.block_table("b")[:2] == hits
    assert kv.pool.ref_count(hits[0]) == 2
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (21, 8)


def test_a_full_hit_still_recomputes_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))
    hit = kv.find_prefix(again)                        # 7 tokens at most: one whole block,
    assert len(hit.blocks) == 1                        # then 3 of the next one, copied
    assert (hit.num_tokens, hit.partial_tokens) == (7, 3)


def test_a_prefix_ending_inside_a_block_copies_that_blocks_leading_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, make_request("a", list(range(10))))  # caches [0-3] and [4-7]
    a_table = kv.block_table("a")
    assert kv.take_copies() == []
    b = make_request("b", [0, 1, 2, 3, 4, 5, 60, 61, 62])
    assert run_prefill(kv, b) == a_table[:1]
    b_table = kv.block_table("b")
    assert b_table[1] not in a_table                   # its own block: cached ones never change
    assert kv.take_copies() == [BlockCopy(src=a_table[1], dst=b_table[1], num_tokens=2)]
    assert kv.take_copies() == []                      # handed over once
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (19, 6)
    # the closest of several cached continuations wins; none sharing a token means no copy
    c = make_request("c", [0, 1, 2, 3, 4, 5, 60, 70, 71])
    hit = kv.find_prefix(c)
    assert (hit.partial_block, hit.partial_tokens) == (b_table[1], 3)
    d = make_request("d", [0, 1, 2, 3, 99, 5, 6])
    assert kv.find_prefix(d) == PrefixHit(a_table[:1], 4)


def test_a_finished_requests_last_partial_block_is_reused_to_the_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))              # [0-3] [4-7] cached, [8, 9] not yet
    run_prefill(kv, a)
    *full, tail = kv.block_table("a")
    assert kv.pool.num_cached_blocks == 2
    kv.free(a)
    assert kv.pool.num_cached_blocks == 3 and kv.pool.ref_count(tail) == 0
    turn2 = make_request("b", list(range(10)) + [20, 21])
    hit = kv.find_prefix(turn2)
    assert hit == PrefixHit(full, 10, tail, 2)
    assert kv.allocate_slots(turn2, turn2.num_tokens, hit)
    # the tail, an idle cached leaf right after b's last hit block, is held while b's blocks
    # are placed (the pool can spare it), so it stays cached and b copies it into its own
    *b_full, b_own = kv.block_table("b")
    assert b_full == full and b_own != tail
    assert kv.take_copies() == [BlockCopy(tail, b_own, 2)]
    assert kv.pool.num_cached_blocks == 3 and kv.pool.num_evictions == 0
    assert kv.pool.ref_count(tail) == 0                 # held only while placing
    # no tail is kept for a request that opted out, nor for one shorter than a block
    for request in (make_request("c", [5] * 6, prefix_cache=False), make_request("d", [6, 7])):
        run_prefill(kv, request)
        before = kv.pool.num_cached_blocks
        kv.free(request)
        assert kv.pool.num_cached_blocks == before


def test_partial_matches_follow_evictions():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    kv.allocate_slots(make_request("x", [9]), 4)       # the empty block
    kv.allocate_slots(make_request("y", [9]), 4)       # evicts the leaf [4-7]
    hit = kv.find_prefix(make_request("b", [0, 1, 2, 3, 4, 5, 6]))
    assert (hit.num_tokens, hit.partial_tokens) == (4, 0)


def test_salted_requests_never_share_a_block():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    run_prefill(kv, make_request("plain", list(range(12))))
    assert run_prefill(kv, make_request("t1", list(range(12)), salt="tenant-1")) == []
    assert run_prefill(kv, make_request("t2", list(range(12)), salt="tenant-2")) == []
    assert len(run_prefill(kv, make_request("t1b", list(range(12)), salt="tenant-1"))) == 2
    tables = [set(kv.block_table(r)) for r in ("plain", "t1", "t2")]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])


def test_opted_out_requests_neither_reuse_nor_store():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, make_request("a", list(range(8)), prefix_cache=False))
    assert kv.pool.num_cached_blocks == 0
    run_prefill(kv, make_request("b", list(range(9))))
    assert run_prefill(kv, make_request("c", list(range(9)), prefix_cache=False)) == []
    off = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    run_prefill(off, make_request("a", list(range(9))))
    assert off.pool.num_cached_blocks == 0


def test_generated_tokens_are_cached_once_computed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", [1, 2, 3])
    run_prefill(kv, r)
    for t in (4, 5):                                   # two decode steps
        r.append_output(t)
        assert kv.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens - 1       # the newest token's KV comes next step
        kv.cache_full_blocks(r)
    assert kv.pool.num_cached_blocks == 1              # [1, 2, 3, 4] is full and computed
    keys = extend_keys([], [1, 2, 3, 4], 4)
    assert kv.pool.lookup(keys[0]) == kv.block_table("a")[0]


def test_generated_tokens_kv_is_never_shared_where_only_prompt_kv_may_be():
    """share_generated=False (a deterministic engine): blocks with a generated token stay out
    of the cache, the partial tail stops at the prompt, and a later prompt that repeats the
    answer hits only the first one's prompt."""
    for share, want in ((False, 6), (True, 9)):
        kv = KVCacheManager(num_blocks=10, block_size=4, share_generated=share)
        r = make_request("a", [1, 2, 3, 4, 5, 6])
        run_prefill(kv, r)
        for t in (7, 8, 9):                            # three decode steps
            r.append_output(t)
            assert kv.allocate_slots(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens - 1
            kv.cache_full_blocks(r)
        # [1..4]; [5, 6, 7, 8] holds generated tokens
        assert kv.pool.num_cached_blocks == (1 if not share else 2)
        r.num_computed_tokens = r.num_tokens
        kv.free(r)                                     # the tail: [5, 6] or [9]
        later = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
        assert kv.find_prefix(later).num_tokens == want


def test_tables_grow_and_refuse_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", [0] * 9), make_request("b", [1] * 5)
    assert kv.allocate_slots(a, 5) and kv.block_table("a") == [0, 1]
    assert kv.allocate_slots(a, 8) and kv.block_table("a") == [0, 1]
    assert kv.allocate_slots(a, 9) and kv.block_table("a") == [0, 1, 2]
    assert not kv.allocate_slots(b, 5)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.free(a)
    assert kv.num_free_blocks == 4
    kv.free(make_request("unknown", [1]))


def test_block_tables_stay_one_run_while_requests_grow_side_by_side():
    """Decode attention reads a request's blocks in turn, and adjacent ones stream (the
    block_pool docstring): a new request's blocks are followed by room for the rest of it
    (prompt + max_tokens), which a request admitted after it does not take."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a, b = make_request("a", [0] * 8), make_request("b", [1] * 8)   # 8 + max_tokens 8
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    assert kv.block_table("a") == [0, 1] and kv.block_table("b") == [4, 5]
    for n in (12, 16):
        assert kv.allocate_slots(a, n) and kv.allocate_slots(b, n)
    assert kv.block_table("a") == [0, 1, 2, 3] and kv.block_table("b") == [4, 5, 6, 7]
    assert kv.num_free_blocks == 24


def test_room_kept_for_one_request_is_still_free_for_others():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", [0] * 8)                  # 2 blocks, room for 2 more
    assert kv.allocate_slots(a, 8) and kv.num_free_blocks == 4
    b = make_request("b", [1] * 16)
    assert kv.allocate_slots(b, 16)                 # 2 empty blocks, then a's room
    assert kv.block_table("b") == [2, 3, 4, 5] and kv.num_free_blocks == 0
    assert not kv.allocate_slots(a, 12)             # a's room went to b: a waits
    kv.free(b)
    assert kv.allocate_slots(a, 12) and kv.block_table("a") == [0, 1, 2]


def test_keys_chain_and_depend_on_the_salt():
    k0 = block_key(None, [1, 2])
    assert block_key(None, [1, 2]) == k0 != block_key(None, [1, 2], "s")
    assert block_key(k0, [3, 4]) != block_key(block_key(None, [9, 9]), [3, 4])
    assert extend_keys([], [1, 2, 3, 4, 5], 2) == [k0, block_key(k0, [3, 4])]


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_eviction_is_leaf_first_whatever_the_policy(policy):
    """A parent released long before its child is still evicted after it: evicting the
    parent would strand the child (lookups stop at the first miss)."""
    pool = BlockPool(4, policy)
    parent, child, other = pool.allocate(3)
    pool.cache(parent, 1, None, 0, range(16))
    pool.cache(child, 2, 1, 1, range(16))
    pool.cache(other, 3, None, 0, range(16))
    pool.free([parent])              # released first: LRU's first choice if it were a leaf
    pool.free([other])
    pool.free([child])
    reuse(pool, other, 3)            # so LFU and cost prefer to keep `other`
    assert pool.allocate(1) == [3]   # the empty block
    assert pool.allocate(1) == [child]
    assert pool.lookup(1) == parent  # the parent became a leaf, and stays cached until needed
    assert pool.allocate(1) == [parent]
    assert pool.allocate(1) == [other]


def test_kv_caches_on_huge_pages_are_zeroed_caches_of_the_asked_shape():
    """huge_page_zeros only advises the OS (transparent huge pages where it takes the
    advice); the tensors are the zeros torch.zeros makes, and the engine's caches work."""
    from ember.engine.memory import huge_page_zeros
    from ember.runner.kv_tensors import allocate_kv_caches
    config = SimpleNamespace(num_kv_heads=2, head_dim=64, num_layers=3)
    for kv_dtype in ("model", "int8"):
        caches = allocate_kv_caches(config, 300, 16, torch.bfloat16, "cpu", kv_dtype,
                                    zeros=huge_page_zeros)
        plain = allocate_kv_caches(config, 300, 16, torch.bfloat16, "cpu", kv_dtype)
        for got, want in zip(caches, plain):
            assert torch.equal(got.data, want.data) and got.data.dtype == want.data.dtype
            assert (got.scale is None) == (want.scale is None)
            if got.scale is not None:
                assert torch.equal(got.scale, want.scale)
        k = torch.randn(4, 2, 64).to(torch.bfloat16)
        caches[0].write(k, k, torch.tensor([0, 17, 300, 4799]))
        assert caches[0].data.abs().sum() > 0


def test_lazy_kv_zeros_never_hold_memory_the_process_used_before():
    """The KV cache is allocated without touching it, and attention reads blocks nobody has
    written yet (a partly filled block's tail, weighted zero): NaN * 0 is NaN, so those
    bytes must be zeros, not what a freed tensor left there. Freed NaN-filled tensors of
    the same sizes first, so that an allocator reusing memory would hand them back."""
    from ember.engine.memory import lazy_zeros
    for shape in [(2, 2, 8, 16, 64), (2, 3, 300, 16, 64)]:   # 64 KiB (a heap's) and 3.5 MiB
        for dtype in (torch.bfloat16, torch.float16, torch.int8):
            dirty = [torch.full(shape, float("nan") if dtype.is_floating_point else -1,
                                dtype=dtype) for _ in range(4)]
            del dirty
            got = lazy_zeros(shape, dtype, "cpu")
            assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
            assert torch.equal(got, torch.zeros(shape, dtype=dtype))
            got[1, 1, 7] = 3    # written like any tensor, and the bytes around stay zero
            assert got.count_nonzero() == 16 * 64


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (Linux /proc/self/smaps)."""
    inside, flags = False, []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


def _resident_fraction(t: torch.Tensor) -> float:
    """The fraction of the 4 KiB pages under `t` mapped (Linux mincore; a page only read
    maps the shared zero page, and counts)."""
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = t.data_ptr() // 4096 * 4096
    pages = -(-(t.data_ptr() + t.nbytes - start) // 4096)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * 4096), vec) == 0
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_fault_in_brings_a_lazy_cache_into_memory_a_huge_page_a_step_keeping_it():
    """An idle engine faults its lazily mapped KV cache in (fault_in): one huge page of one
    plane per step, the cache resident at the end, and what requests wrote there kept."""
    from ember.engine.memory import HUGE_PAGE, fault_in, lazy_zeros
    shape = (2, 3, 2500, 16, 64)          # 6 planes of 2.4 MiB: two huge pages each
    cache = lazy_zeros(shape, torch.int8, "cpu")
    scale = lazy_zeros(shape[:-1], torch.float16, "cpu")
    before = (torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1], dtype=torch.float16))
    g = torch.Generator().manual_seed(5)
    written = torch.randint(-127, 128, (2, 3, 16, 64), generator=g, dtype=torch.int8)
    for c, s in (cache, scale), before:   # (read, even a zero page counts as mapped)
        c[:, :, 7] = written
        c[1, 2, 2400] = 9                 # past the first huge page of the last plane
        s[:, :, 7] = 0.5
    assert _resident_fraction(cache) < 0.5
    steps = fault_in([cache, scale], planes=6)
    for _ in range(6):                    # the first huge page of each of the cache's planes
        next(steps)
    assert 0.5 < _resident_fraction(cache) < 1
    assert all(_resident_fraction(cache[w, h, :2048]) == 1 for w in range(2) for h in range(3))
    rest = sum(1 for _ in steps)
    assert rest == 6 + 6                  # the cache's second huge pages, the scales' pages
    assert _resident_fraction(cache) == 1 and _resident_fraction(scale) == 1
    assert torch.equal(cache, before[0]) and torch.equal(scale, before[1])
    assert HUGE_PAGE < cache.nbytes // 6 < 2 * HUGE_PAGE


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_fault_in_without_madvise_rewrites_each_page_with_itself(monkeypatch):
    """Where the kernel lacks MADV_POPULATE_WRITE (or there is no libc to ask), each page's
    first byte is written back as it is: resident, and unchanged."""
    from ember.engine import memory
    monkeypatch.setattr(memory, "_libc", lambda: None)
    cache = memory.lazy_zeros((2, 1, 700, 16, 64), torch.int8, "cpu")
    before = torch.zeros(cache.shape, dtype=torch.int8)
    for c in cache, before:
        c[0, 0, 3] = 5
        c[1, 0, 0, 0, 0] = -3             # the first byte of a plane, on a page boundary
    assert _resident_fraction(cache) < 0.5
    assert sum(1 for _ in memory.fault_in([cache], planes=2)) == 2
    assert _resident_fraction(cache) == 1
    assert torch.equal(cache, before)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_the_kv_cache_is_advised_as_huge_pages_only_when_asked():
    """lazy_zeros maps the cache without the huge-page advice (the warm-up's first block
    would fault in 2 MiB under every layer and head); advise_huge_pages gives it after."""
    from ember.engine.memory import HUGE_PAGE, advise_huge_pages, lazy_zeros
    cache = lazy_zeros((2, 2, 256, 16, 64), torch.bfloat16, "cpu")   # 2 MiB: one huge page
    assert cache.data_ptr() % HUGE_PAGE == 0
    assert "hg" not in _vma_flags(cache.data_ptr())
    advise_huge_pages([cache])
    if "hg" not in _vma_flags(cache.data_ptr()):
        pytest.skip("this kernel has no transparent huge pages to advise")
    assert torch.equal(cache, torch.zeros_like(cache))


def test_weights_moved_to_huge_pages_keep_their_values_on_their_modules():
    """move_to_huge_pages puts the buffers side by side in one advised buffer (views of one
    storage, each 64-byte aligned) with the values, dtypes and shapes they had, registered
    back on their modules. (The engine's reference tests run on weights so moved.)"""
    from ember.engine.memory import move_to_huge_pages
    g = torch.Generator().manual_seed(3)
    modules = [torch.nn.Module(), torch.nn.Module()]
    for i, m in enumerate(modules):
        m.register_buffer("packed", torch.randint(-128, 128, (40 - 32 * i, 48 - 8 * i),
                                                  generator=g, dtype=torch.int8))
        m.register_buffer("scale", torch.rand(40 - 32 * i, generator=g).bfloat16())
    want = [t.clone() for m in modules for t in (m.packed, m.scale)]
    owners = [(m, name) for m in modules for name in ("packed", "scale")]
    moved = move_to_huge_pages(owners)
    got = [getattr(m, name) for m, name in owners]
    assert moved == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in want)
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1
    for g_t, w_t in zip(got, want):
        assert torch.equal(g_t, w_t) and g_t.dtype == w_t.dtype and g_t.is_contiguous()
        assert g_t.data_ptr() % 64 == 0
    assert dict(modules[0].named_buffers())["packed"] is got[0]


def _mapping_rss_kib(path: str) -> int:
    """The resident KiB of this process's mappings of the file `path` (Linux smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) == 6 and fields[5] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_weights_moved_out_of_a_file_leave_its_pages(tmp_path):
    """The weight cache's tensors are a mapping of its file: once move_to_huge_pages has
    copied one, the file's pages under it leave the process (else they stay resident beside
    the copy); the copy holds the values, and the old tensor reads them back from the file."""
    from safetensors.torch import load_file, save_file

    from ember.engine.memory import move_to_huge_pages
    g = torch.Generator().manual_seed(4)
    want = torch.randint(-128, 128, (2048, 1024), generator=g, dtype=torch.int8)   # 2 MiB
    path = tmp_path / "weights.safetensors"
    save_file({"w": want}, path)
    loaded = load_file(path)["w"]
    module = torch.nn.Module()
    module.register_buffer("w", loaded)
    assert torch.equal(module.w, want)                 # read: the file's pages mapped
    assert _mapping_rss_kib(str(path)) >= 2048
    move_to_huge_pages([(module, "w")])
    assert _mapping_rss_kib(str(path)) < 64            # at most the pages at its ends
    assert torch.equal(module.w, want) and module.w.data_ptr() != loaded.data_ptr()
    assert torch.equal(loaded, want)


def test_a_shared_weight_moved_to_huge_pages_is_copied_once_and_stays_shared():
    """A tied embedding names its output projection's int8 tensors: moved, both modules
    still share one tensor (copied once); a view of those bytes as another dtype gets its
    own copy; a None buffer is left as it is."""
    from ember.engine.memory import move_to_huge_pages
    head, embed = torch.nn.Module(), torch.nn.Module()
    head.register_buffer("packed", torch.arange(-100, 92, dtype=torch.int8).view(12, 16))
    head.register_buffer("quads", None)
    embed.register_buffer("packed", head.packed)
    raw = torch.nn.Module()   # the same bytes as another dtype: a copy of its own
    raw.register_buffer("packed", head.packed.view(torch.uint8))
    want = head.packed.clone()
    moved = move_to_huge_pages([(embed, "packed"), (head, "packed"), (head, "quads"),
                                (raw, "packed")])
    assert moved == 2 * 192
    assert embed.packed is head.packed and torch.equal(head.packed, want)
    assert raw.packed.dtype == torch.uint8 and torch.equal(raw.packed, want.view(torch.uint8))
    assert head.quads is None
