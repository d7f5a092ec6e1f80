"""What the gateway learns of replicas' caches: KV events with a cursor, routed blocks with
a TTL, and the text tree for replicas without events."""
from __future__ import annotations

from ember.kv.prefix_cache import extend_keys
from ember.router.kv_index import BlockIndex, TextIndex, text_keys


def stored(seq: int, key: int) -> dict:
    return {"seq": seq, "type": "stored", "block_hash": key, "parent_block_hash": None,
            "num_tokens": 16}


def test_events_add_and_remove_blocks_and_advance_the_cursor():
    keys = extend_keys([], list(range(64)), 16)
    index = BlockIndex()
    assert index.apply({"events": [stored(i, k) for i, k in enumerate(keys)],
                        "dropped": False, "block_size": 16})
    assert (index.cursor, index.block_size, index.matched(keys, 0.0)) == (3, 16, 4)
    index.apply({"events": [{"seq": 4, "type": "removed", "block_hash": keys[2]}]})
    assert index.matched(keys, 0.0) == 2  # a lookup stops at the first missing block
    assert index.cursor == 4


def test_first_contact_and_a_gap_in_the_log_take_a_snapshot():
    index = BlockIndex()
    assert index.query() == "snapshot=1"
    assert index.apply({"snapshot": [{"block_hash": 11, "parent_block_hash": None,
                                      "num_tokens": 16}], "cursor": 7, "block_size": 16,
                        "model": "m"})
    assert (index.blocks, index.cursor, index.model, index.query()) == ({11}, 7, "m", "after=7")
    index.apply({"events": [stored(8, 12)], "dropped": False})
    assert not index.apply({"events": [stored(50, 13)], "dropped": True})
    assert (index.cursor, index.blocks, index.resyncs) == (-1, set(), 1)
    assert index.query() == "snapshot=1"
    assert index.apply({"snapshot": [], "cursor": 50, "block_size": 16})
    assert (index.blocks, index.query(), index.model) == (set(), "after=50", "m")


def test_a_server_without_snapshots_is_read_from_its_oldest_event():
    """A server that ignores `snapshot=1` answers the events after -1: taken as they are."""
    index = BlockIndex()
    assert index.apply({"events": [stored(40, 13), stored(50, 12)], "dropped": True})
    assert (index.blocks, index.query()) == ({12, 13}, "after=50")


def test_routed_blocks_count_until_their_ttl():
    keys = extend_keys([], list(range(48)), 16)
    index = BlockIndex()
    index.note_routed(keys[:2], expiry=10.0)
    assert index.matched(keys, now=9.0) == 2
    assert index.matched(keys, now=10.0) == 0
    index.expire(10.0)
    assert index.routed == {}


def test_text_tree_matches_shared_leading_chunks_and_forgets_the_oldest():
    system = "You are a helpful assistant for the tenant Acme. " * 4
    a, b = text_keys(system + "Q1?", 16), text_keys(system + "Something else", 16)
    tree = TextIndex(max_chunks=100)
    tree.insert(a)
    assert tree.matched(b) == len(system) // 16
    assert tree.matched(text_keys("other " * 20, 16)) == 0
    small = TextIndex(max_chunks=3)
    small.insert(a)
    assert small.matched(a) == 0 and len(small.nodes) == 3  # the first chunks went first
