"""A pool of fixed-size KV blocks with reference counts and a prefix cache.

A block is `block_size` token slots in every layer's KV tensor. A block whose tokens are all
computed can be *cached* under its chained key (prefix_cache.py); a later request with the same
prefix reuses it instead of recomputing it. A cached block that no request uses stays cached
until its slot is needed: empty blocks are handed out first, then the eviction policy picks
which cached block to give up. Every block stored or removed is logged as a KV event, for
routers that want to know what this replica holds.

A cached block also remembers its token ids, so that a prompt which leaves a cached prefix in
the middle of a block can still reuse that block's leading tokens (`longest_partial`): the
caller copies those slots into a fresh block of its own, since the cached block is immutable.

Eviction is leaf first, whatever the policy: a cached block whose child is still cached is
not a candidate (it waits, "parked"), because a lookup walks a prompt's keys from the start
and stops at the first miss, so evicting a parent would strand all its descendants.

    block states:  empty (free) -> in use (ref > 0) -> cached and idle (ref 0) -> evicted
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ember.kv.eviction import Candidate, make_policy


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str                         # "stored" | "removed"
    block_key: int
    parent_key: int | None = None     # stored only
    num_tokens: int = 0               # stored only: tokens in the block


@dataclass
class _Meta:
    key: int | None = None
    parent_key: int | None = None
    depth: int = 0
    token_ids: tuple[int, ...] = ()
    hits: int = 0
    released: int = 0  # logical time its last user let it go


class BlockPool:
    def __init__(self, num_blocks: int, policy: str = "lru", max_events: int = 10_000) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._meta = [_Meta() for _ in range(num_blocks)]
        self._empty: deque[int] = deque(range(num_blocks))
        self._idle = make_policy(policy)           # cached leaves with no user
        self._parked: set[int] = set()             # cached, no user, but a child is cached
        self._children: dict[int, set[int]] = {}   # key -> its cached children (block ids)
        self._by_key: dict[int, int] = {}
        self._clock = 0
        self.num_evictions = 0
        self.events: deque[KVEvent] = deque(maxlen=max_events)
        self.next_event_seq = 0

    @property
    def policy(self) -> str:
        return self._idle.name

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones and idle cached ones (a parked block
        becomes a leaf once its children go, so all of them can be had)."""
        return len(self._empty) + len(self._idle) + len(self._parked)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_key)

    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1] (idle cached blocks are free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- handing out and taking back -------------------------------------------------------

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks (ref count 1 each): empty ones first, then evicted cached ones.
        The caller checks num_free_blocks first."""
        if num > self.num_free_blocks:
            raise RuntimeError(f"asked for {num} blocks with {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num):
            if self._empty:
                block_id = self._empty.popleft()
            else:
                block_id = self._idle.pop()
                self._uncache(block_id)
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. A block nobody uses goes back to the pool: empty
        if it was never cached, else idle (still cached) in its eviction policy."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                meta = self._meta[block_id]
                if meta.key is None:
                    self._empty.append(block_id)
                else:
                    self._clock += 1
                    meta.released = self._clock
                    self._make_candidate(block_id)

    def _make_candidate(self, block_id: int) -> None:
        meta = self._meta[block_id]
        if self._children.get(meta.key):
            self._parked.add(block_id)
        else:
            self._idle.insert(block_id, Candidate(meta.hits, meta.depth, meta.released))

    # -- the prefix cache ------------------------------------------------------------------

    def lookup(self, key: int) -> int | None:
        return self._by_key.get(key)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks a request reuses (a cache hit)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id in self._parked:
                    self._parked.remove(block_id)
                else:
                    self._idle.remove(block_id)
            self._ref_counts[block_id] += 1
            self._meta[block_id].hits += 1

    def longest_partial(self, parent_key: int, token_ids: list[int]) -> tuple[int, int]:
        """The cached child of `parent_key` whose tokens start with the longest run of
        `token_ids`: (block id, length of the run), or (-1, 0) when none shares a token."""
        best, best_len = -1, 0
        for block_id in self._children.get(parent_key, ()):
            cached = self._meta[block_id].token_ids
            n = 0
            for a, b in zip(cached, token_ids):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block_id, n
        return best, best_len

    def cache(self, block_id: int, key: int, parent_key: int | None, depth: int,
              token_ids: Sequence[int]) -> None:
        """Record that `block_id` holds the prefix `key`, its last tokens being `token_ids`.
        If another block already does (two requests computed the same prefix at once), the
        first stays the cached one."""
        meta = self._meta[block_id]
        if meta.key is not None or key in self._by_key:
            return
        meta.key, meta.parent_key, meta.depth, meta.hits = key, parent_key, depth, 0
        meta.token_ids = tuple(token_ids)
        self._by_key[key] = block_id
        if parent_key is not None:
            self._children.setdefault(parent_key, set()).add(block_id)
        self._log("stored", key, parent_key, len(meta.token_ids))

    def _uncache(self, block_id: int) -> None:
        meta = self._meta[block_id]
        del self._by_key[meta.key]
        self._children.pop(meta.key, None)
        self._log("removed", meta.key)
        self._meta[block_id] = _Meta()
        parent = meta.parent_key
        siblings = self._children.get(parent) if parent is not None else None
        if siblings is not None:
            siblings.discard(block_id)
            if siblings:
                return
            del self._children[parent]
            parent_block = self._by_key.get(parent)
            if parent_block in self._parked:
                self._parked.remove(parent_block)  # now a leaf: a candidate again
                self._make_candidate(parent_block)

    def _log(self, kind: str, key: int, parent_key: int | None = None,
             num_tokens: int = 0) -> None:
        self.events.append(KVEvent(self.next_event_seq, kind, key, parent_key, num_tokens))
        self.next_event_seq += 1

    def events_after(self, seq: int) -> tuple[list[KVEvent], bool]:
        """Events with seq > `seq`, and whether older ones were dropped from the log."""
        snapshot = list(self.events)  # one C-level copy: safe while the engine thread appends
        events = [e for e in snapshot if e.seq > seq]
        dropped = bool(snapshot) and snapshot[0].seq > seq + 1
        return events, dropped
