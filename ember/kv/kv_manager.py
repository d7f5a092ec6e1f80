"""Per-request block tables and the prefix-cache lookups: the only view of KV memory the
scheduler sees.

Token i of a request lives in block `table[i // block_size]`, slot `i % block_size`. A new
request first reuses the longest run of cached blocks that matches its prompt, never its last
token: that one is recomputed so the step has logits to sample from. Where the match ends
inside a block (a shared system prompt seldom fills whole blocks), the leading tokens of the
cached block that continues it are copied into the request's own next block, so only the
tokens after the shared prefix are computed; the copies ride in the step's plan and the runner
makes them before it writes any KV. Blocks whose tokens are all computed are cached as soon as
they fill, generated tokens too, and a request's last, partly filled block is cached when it
finishes (keyed by its parent and the tokens it holds, found only by partial matching), so the
next turn of a conversation finds the whole previous answer cached. A request whose next
uncached block is one a running prompt is still computing waits for it (computing_keys,
next_block_computing): requests that share a prefix and arrive together compute it once.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ember.kv.block_pool import BlockPool
from ember.kv.prefix_cache import block_key, extend_keys
from ember.request import Request

MAX_ROOM_BLOCKS = 64  # room kept after a new request's blocks, at most (block_pool)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixHit:
    """What the cache holds of a prompt: whole cached blocks, then maybe the leading
    `partial_tokens` of `partial_block` (copied, not shared)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    partial_block: int = -1
    partial_tokens: int = 0


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first `num_tokens` slots of block `src` into block `dst`."""

    src: int
    dst: int
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 policy: str = "lru", window: int | None = None,
                 share_generated: bool = True, max_events: int = 10_000) -> None:
        self.block_size = block_size
        # whether generated tokens' KV is cached for others: a decode row computes it with
        # other numerics than a prompt row would, so a later prompt that repeats those tokens
        # (the next turn of a chat) would read KV its own prompt rows never make, and its
        # answer would depend on the cache (the engine shares prompt KV only)
        self.share_generated = share_generated
        # tokens every layer attends back over (sliding-window models), None: all of them.
        # With a window, the blocks behind it go back to the pool instead of being cached:
        # the pool evicts cached chains from their ends, never from their starts.
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching and window is None
        self.pool = BlockPool(num_blocks, policy, max_events)
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[int]] = {}       # chained keys of each request's full blocks
        self._num_cached: dict[str, int] = {}       # how many of its blocks are in the cache
        self._num_released: dict[str, int] = {}     # its first blocks, out of every window
        self._copies: list[BlockCopy] = []          # for the step being planned
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def _uses_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching and request.prefix_cache

    def _request_keys(self, request: Request) -> list[int]:
        keys = self._keys.setdefault(request.request_id, [])
        return extend_keys(keys, request.all_token_ids, self.block_size, request.cache_salt)

    def computing_keys(self, running: Iterable[Request]) -> set[int]:
        """Keys of the full prompt blocks that `running` requests have yet to compute or cache:
        blocks a request sharing the prefix would compute a second time if it started now."""
        keys: set[int] = set()
        for request in running:
            known = self._keys.get(request.request_id)
            if known:
                full = min(request.num_prompt_tokens // self.block_size, len(known))
                keys.update(known[self._num_cached.get(request.request_id, 0):full])
        return keys

    def next_block_computing(self, request: Request, computing: set[int]) -> bool:
        """Whether the first block of `request` past what the cache holds is in `computing`
        (computing_keys): started a step or more later, it finds that block cached. Does not
        count as a lookup in the hit statistics."""
        if not computing or not self._uses_cache(request) or request.num_computed_tokens:
            return False
        keys, hits = self._cached_blocks(request)
        return len(hits) < len(keys) and keys[len(hits)] in computing

    def _max_hit(self, request: Request) -> int:
        """The most tokens a hit may cover: never the last one (it is recomputed to sample),
        and none past the prompt unless generated tokens' KV is shared."""
        if self.share_generated:
            return request.num_tokens - 1
        return min(request.num_tokens - 1, request.num_prompt_tokens)

    def _num_shareable(self, request: Request) -> int:
        """The request's leading computed tokens whose KV may be cached for others."""
        if self.share_generated:
            return request.num_computed_tokens
        return min(request.num_computed_tokens, request.num_prompt_tokens)

    def _cached_blocks(self, request: Request) -> tuple[list[int], list[int]]:
        """The keys of the request's full blocks that a hit may cover (_max_hit) and the
        cached blocks that match their start."""
        keys = self._request_keys(request)[:self._max_hit(request) // self.block_size]
        hits = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return keys, hits

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest prefix of `request` the cache holds (possibly nothing).

        Counts the lookup in the hit statistics; call it once per admission.
        """
        if not self._uses_cache(request):
            return PrefixHit()
        keys, hits = self._cached_blocks(request)
        max_tokens = self._max_hit(request)
        hit = PrefixHit(hits, len(hits) * self.block_size)
        if hits:  # partial matches hang off a cached parent: the first block has none
            start = hit.num_tokens
            tokens = request.all_token_ids[start:min(start + self.block_size, max_tokens)]
            src, n = self.pool.longest_partial(keys[len(hits) - 1], tokens)
            if n:
                hit = PrefixHit(hits, start + n, src, n)
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += hit.num_tokens
        return hit

    def allocate_slots(self, request: Request, num_tokens: int,
                       hit: PrefixHit | None = None) -> bool:
        """Make the request's table cover its first `num_tokens` tokens, starting with the
        cache hit `hit` for a request that has no blocks yet.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        computed = hit.blocks if hit is not None else []
        table = self._tables.get(request.request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table) - len(computed)
        if num_new <= 0 and not computed:
            return True   # the table covers them already (most decode steps)
        idle_hits = sum(1 for b in computed if self.pool.ref_count(b) == 0)
        if num_new + idle_hits > self.pool.num_free_blocks:
            return False
        if computed:
            self.pool.touch(computed)
            self._num_cached[request.request_id] = len(computed)
        if computed or num_new > 0:
            held = table + computed
            # a new request's blocks are followed by room for the rest of it (block_pool)
            room = 0 if table else min(MAX_ROOM_BLOCKS, max(0, cdiv(
                request.num_prompt_tokens + request.max_tokens, self.block_size)
                - len(held) - num_new))
            src = self._hold_copy_source(hit, num_new + idle_hits)
            new_blocks = (self.pool.allocate(num_new, after=held[-1] if held else None,
                                             room=room) if num_new > 0 else [])
            if src >= 0:
                self.pool.free([src])
            table = held + new_blocks
            self._tables[request.request_id] = table
            if hit is not None and hit.partial_tokens:
                # The source is not held past placement: if this step's allocations evict it,
                # its slots are only overwritten by this step's forward, after the copies.
                self._copies.append(BlockCopy(hit.partial_block, new_blocks[0],
                                              hit.partial_tokens))
        return True

    def _hold_copy_source(self, hit: PrefixHit | None, num_needed: int) -> int:
        """Take a reference to the block a partial hit copies from, while the pool can spare
        it, so that placing the new blocks (which takes the idle leaf right after the last
        one) does not evict it: its copy would be cached again when this request finishes,
        a removed and a stored event for every repeat of a prompt. Returns the block held,
        or -1."""
        if hit is None or not hit.partial_tokens:
            return -1
        src = hit.partial_block
        if num_needed + (self.pool.ref_count(src) == 0) > self.pool.num_free_blocks:
            return -1
        self.pool.touch([src])
        return src

    def take_copies(self) -> list[BlockCopy]:
        """The block copies the step being planned needs, in order; clears the list."""
        copies, self._copies = self._copies, []
        return copies

    def return_copies(self, copies: list[BlockCopy]) -> None:
        """Copies taken for a step that did not run go first into the next one."""
        self._copies = list(copies) + self._copies

    def cache_full_blocks(self, request: Request) -> None:
        """Cache the request's blocks whose tokens have all been computed."""
        if not self._uses_cache(request):
            return
        rid = request.request_id
        table = self._tables.get(rid, [])
        num_full = min(self._num_shareable(request) // self.block_size, len(table))
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        keys = self._request_keys(request)
        for i in range(start, num_full):
            self.pool.cache(table[i], keys[i], keys[i - 1] if i else None, depth=i,
                            token_ids=request.all_token_ids[i * self.block_size:
                                                            (i + 1) * self.block_size])
        self._num_cached[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens: the slots that
        held rejected speculative tokens. Those blocks were never cached (only blocks whose
        tokens are all computed and accepted are), so they go back empty, with no hash."""
        table = self._tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        self.pool.free(extra[::-1])

    def release_outside_window(self, request: Request) -> None:
        """Give back the request's blocks that no later token can attend to: with a window w,
        a token at position p >= num_computed_tokens sees keys after p - w. Their ids stay in
        the table (attention masks them out), so that positions keep their blocks' places."""
        if self.window is None:
            return
        rid = request.request_id
        table = self._tables.get(rid, [])
        first_needed = request.num_computed_tokens - self.window + 1
        num_out = min(max(0, first_needed) // self.block_size, len(table))
        start = self._num_released.get(rid, 0)
        if num_out > start:
            self.pool.free(table[start:num_out][::-1])
            self._num_released[rid] = num_out

    def free(self, request: Request) -> None:
        """Return all of a request's blocks (finished or preempted). Its last, partly filled
        block stays cached as a partial block when the blocks before it are cached, so the
        next turn of a conversation reuses it to the token. Freeing a request that holds no
        blocks does nothing."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        released = self._num_released.pop(rid, 0)
        if table:
            self._cache_tail(request, table)
            # Tail first: a prompt's last blocks are the least likely to be shared, so under
            # LRU they are evicted before the blocks that start it.
            self.pool.free(table[released:][::-1])
        self._keys.pop(rid, None)
        self._num_cached.pop(rid, None)

    def allocate_external(self, request: Request) -> PrefixHit | None:
        """Blocks for a request's first `num_external_tokens` tokens, whose KV another replica
        computed: the cached blocks that hold their start, whole (they need no copy), then
        fresh ones for the rest, which the caller fills. A partial hit is not used: its copy
        into the first fresh block would race the transfer writing it. Returns the hit used,
        or None, changing nothing, when the pool has too few free blocks."""
        hit = self.find_prefix(request)
        whole = PrefixHit(hit.blocks, len(hit.blocks) * self.block_size)
        if not self.allocate_slots(request, request.num_external_tokens, whole):
            return None
        return whole

    def detach(self, request: Request) -> list[int]:
        """Hand over a finished request's blocks instead of freeing them: they stay allocated
        (so nothing reuses or evicts them), in no request's table, until release_blocks().
        Its blocks are cached as free() caches them."""
        rid = request.request_id
        table = self._tables.pop(rid, [])
        if table:
            self._cache_tail(request, table)
        self._keys.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._num_released.pop(rid, None)
        return table

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks detach() handed over (last first, as free() does)."""
        self.pool.free(block_ids[::-1])

    def _cache_tail(self, request: Request, table: list[int]) -> None:
        shareable = self._num_shareable(request)
        index, used = divmod(shareable, self.block_size)
        if not (self._uses_cache(request) and used and 1 <= index < len(table)
                and self._num_cached.get(request.request_id) == index):
            return
        parent = self._request_keys(request)[index - 1]
        if self.pool.lookup(parent) is None:
            return
        tokens = request.all_token_ids[index * self.block_size:shareable]
        self.pool.cache(table[index], block_key(parent, tokens), parent, depth=index,
                        token_ids=tokens)
