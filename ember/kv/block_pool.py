"""A pool of fixed-size KV blocks with reference counts and a prefix cache.

A block is `block_size` token slots in every layer's KV tensor. A block whose tokens are all
computed can be *cached* under its chained key (prefix_cache.py); a later request with the same
prefix reuses it instead of recomputing it. A cached block that no request uses stays cached
until its slot is needed: empty blocks are handed out first, then the eviction policy picks
which cached block to give up. Every block stored or removed is logged as a KV event, for
routers that want to know what this replica holds; a router that is new, or fell behind the
log's window, starts from a snapshot of every cached block instead (`snapshot`).

A cached block also remembers its token ids, so that a prompt which leaves a cached prefix in
the middle of a block can still reuse that block's leading tokens (`longest_partial`): the
caller copies those slots into a fresh block of its own, since the cached block is immutable.

Eviction is leaf first, whatever the policy: a cached block whose child is still cached is
not a candidate (it waits, "parked"), because a lookup walks a prompt's keys from the start
and stops at the first miss, so evicting a parent would strand all its descendants.

Placement: a request's blocks are kept adjacent where they can be, because decode attention
reads a request's K/V block after block, and adjacent blocks stream where scattered ones
each wait on memory (~1.7x faster on the CPU kernels). A request that
grows takes the block right after its last one when that block is empty or an idle cached
leaf (evicting it ahead of the policy's own choice); the blocks of one allocation come in
ascending order; and a new request's run is followed by `room` empty blocks that others are
given last (kept for its growth, but never withheld: they still count as free). A prefix-cache
hit outranks placement: cached blocks a request reuses stay where they are.

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


HeldBlock = tuple[int | None, int]    # a cached block's (parent key, tokens in it)


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
        # empty blocks, oldest freed first, then those kept as room (given out last); both
        # may hold stale ids (blocks taken out of turn), skipped when reached
        self._empty: deque[int] = deque(range(num_blocks))
        self._later: deque[int] = deque()
        self._room: set[int] = set()  # empty blocks kept as room: their ids in _later count
        self._num_empty = num_blocks
        self._idle = make_policy(policy)           # cached leaves with no user
        self._parked: set[int] = set()             # cached, no user, but a child is cached
        self._children: dict[int, set[int]] = {}   # key -> its cached children (block ids)
        self._by_key: dict[int, int] = {}
        self._clock = 0
        self.num_evictions = 0
        self.events: deque[KVEvent] = deque(maxlen=max_events)
        self.next_event_seq = 0
        # every cached key, changed in step with the log (before its seq advances), so that a
        # snapshot and a cursor can be read without a lock while the engine thread runs
        self._held: dict[int, HeldBlock] = {}

    @property
    def policy(self) -> str:
        return self._idle.name

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones and idle cached ones (a parked block
        becomes a leaf once its children go, so all of them can be had)."""
        return self._num_empty + len(self._idle) + len(self._parked)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_key)

    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1] (idle cached blocks are free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- handing out and taking back -------------------------------------------------------

    def allocate(self, num: int, after: int | None = None, room: int = 0) -> list[int]:
        """Take `num` blocks (ref count 1 each). With `after` (the last block of the request
        they extend): the blocks following it while each is empty or an idle cached leaf.
        Then empty blocks, oldest freed first (room kept for others last), then cached ones in
        the eviction policy's order; those in ascending order. With `room`: up to that many
        empty blocks right after the last one taken are kept as its room. The caller checks
        num_free_blocks first."""
        if num > self.num_free_blocks:
            raise RuntimeError(f"asked for {num} blocks with {self.num_free_blocks} free")
        run: list[int] = []
        if after is not None:
            block_id = after + 1
            while len(run) < num and block_id < self.num_blocks and self._take(block_id):
                run.append(block_id)
                block_id += 1
        block_ids = run + sorted(self._take_next() for _ in range(num - len(run)))
        if room and block_ids:
            self._keep_room(block_ids[-1], room)
        return block_ids

    def _take(self, block_id: int) -> bool:
        """Take this block if it is empty or an idle cached leaf; False if it is neither."""
        if self._ref_counts[block_id] or block_id in self._parked:
            return False
        if self._meta[block_id].key is None:
            self._num_empty -= 1  # its id stays queued, skipped when reached (_take_next)
            self._room.discard(block_id)
        else:
            self._idle.remove(block_id)
            self._evict(block_id)
        self._ref_counts[block_id] = 1
        return True

    def _take_next(self) -> int:
        """The empty block freed longest ago (room kept for others last), else the policy's
        eviction candidate."""
        while self._num_empty:
            queue = self._empty if self._empty else self._later
            block_id = queue.popleft()
            if not self._is_empty(block_id) or (queue is self._empty and block_id in self._room):
                continue  # taken out of turn, or kept as room (its id in _later counts)
            self._room.discard(block_id)
            self._num_empty -= 1
            self._ref_counts[block_id] = 1
            return block_id
        block_id = self._idle.pop()
        self._evict(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _keep_room(self, last: int, room: int) -> None:
        """The empty blocks right after `last` (up to `room`) go to the back of the line."""
        for block_id in range(last + 1, min(last + 1 + room, self.num_blocks)):
            if not self._is_empty(block_id) or block_id in self._room:
                break
            self._room.add(block_id)
            self._later.append(block_id)
        self._drop_stale()

    def _drop_stale(self) -> None:
        """Once the two queues together hold more than twice as many ids as there are blocks,
        rebuild both from the ids still empty (each once): room in _later, the rest in
        _empty."""
        if len(self._empty) + len(self._later) <= 2 * self.num_blocks:
            return
        self._empty = deque(b for b in dict.fromkeys(self._empty)
                            if self._is_empty(b) and b not in self._room)
        self._later = deque(b for b in dict.fromkeys(self._later)
                            if self._is_empty(b) and b in self._room)

    def _evict(self, block_id: int) -> None:
        self._uncache(block_id)
        self.num_evictions += 1

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
                    self._num_empty += 1
                    self._drop_stale()
                else:
                    self._clock += 1
                    meta.released = self._clock
                    self._make_candidate(block_id)

    def _is_empty(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0 and self._meta[block_id].key is None

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
        if kind == "stored":
            self._held[key] = (parent_key, num_tokens)
        else:
            del self._held[key]
        self.events.append(KVEvent(self.next_event_seq, kind, key, parent_key, num_tokens))
        self.next_event_seq += 1

    def events_after(self, seq: int) -> tuple[list[KVEvent], bool]:
        """Events with seq > `seq`, and whether older ones were dropped from the log."""
        snapshot = list(self.events)  # one C-level copy: safe while the engine thread appends
        if not snapshot:
            return [], False
        first = snapshot[0].seq   # seqs are consecutive: the log drops only its oldest
        return snapshot[max(0, seq + 1 - first):], first > seq + 1

    def snapshot(self) -> tuple[dict[int, HeldBlock], int]:
        """Every cached block now (key -> parent key, tokens), and the seq to read events
        after: those events applied to the snapshot give the cache as it is then. Any thread
        may ask. The cursor is read first, so the copy holds at least every event up to it,
        and perhaps a few later ones, which replay harmlessly: an event sets its key's state,
        so the last event of each key decides it, whatever the copy already held."""
        cursor = self.next_event_seq - 1
        held = self._held.copy()  # one C-level copy: safe while the engine thread logs
        return held, cursor
