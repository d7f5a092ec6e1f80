"""Block pool and per-request block tables: exact block ids, counts and reuse order."""
from __future__ import annotations

import pytest

from ember.kv.block_pool import BlockPool
from ember.kv.kv_manager import KVCacheManager


def test_pool_hands_out_blocks_in_order_and_reuses_the_oldest_freed_first():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([3, 1])
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [5, 3, 1]
    assert pool.usage() == 1.0


def test_shared_blocks_return_only_when_the_last_reference_goes():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.incref([a])
    pool.free([a])
    assert pool.num_free_blocks == 1 and pool.ref_count(a) == 1
    pool.free([a])
    assert pool.num_free_blocks == 2


def test_double_free_and_overdraw_are_bugs_not_silence():
    pool = BlockPool(1)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    [a] = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a])


def test_tables_grow_a_block_at_a_time():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 5)            # tokens 0-4: two blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 8)            # still fits in two
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 9)
    assert kv.block_table("a") == [0, 1, 2]
    assert not kv.allocate_slots("b", 5)        # one block left, two needed: nothing changes
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.allocate_slots("b", 5)
    assert kv.block_table("b") == [3, 2]        # blocks freed tail-first, reused oldest first
    kv.free("unknown")                          # freeing twice or unknown is harmless
