"""Per-request block tables and the prefix-cache lookups: the only view of KV memory the
scheduler sees.

Token i of a request lives in block `table[i // block_size]`, slot `i % block_size`. A new
request first reuses the longest run of cached blocks that matches its prompt (whole blocks,
and never its last token: that one is recomputed so the step has logits to sample from).
Blocks whose tokens are all computed are cached as soon as they fill, generated tokens too,
so the next turn of a conversation finds the previous answer cached.
"""
from __future__ import annotations

from ember.kv.block_pool import BlockPool
from ember.kv.prefix_cache import extend_keys
from ember.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 policy: str = "lru") -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, policy)
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[int]] = {}       # chained keys of each request's full blocks
        self._num_cached: dict[str, int] = {}       # how many of its blocks are in the cache
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

    def computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks that hold the longest prefix of `request` (possibly none).

        Counts the lookup in the hit statistics; call it once per admission.
        """
        if not self._uses_cache(request):
            return []
        keys = self._request_keys(request)
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is recomputed
        hits = []
        for key in keys[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: Request, num_tokens: int,
                       computed: list[int] | None = None) -> bool:
        """Make the request's table cover its first `num_tokens` tokens, starting with the
        cache hits `computed` for a request that has none yet.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        computed = computed or []
        table = self._tables.get(request.request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table) - len(computed)
        idle_hits = sum(1 for b in computed if self.pool.ref_count(b) == 0)
        if num_new + idle_hits > self.pool.num_free_blocks:
            return False
        if computed:
            self.pool.touch(computed)
            self._num_cached[request.request_id] = len(computed)
        if computed or num_new > 0:
            table = table + computed + (self.pool.allocate(num_new) if num_new > 0 else [])
            self._tables[request.request_id] = table
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Cache the request's blocks whose tokens have all been computed."""
        if not self._uses_cache(request):
            return
        rid = request.request_id
        table = self._tables.get(rid, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        keys = self._request_keys(request)
        for i in range(start, num_full):
            self.pool.cache(table[i], keys[i], keys[i - 1] if i else None, depth=i,
                            num_tokens=self.block_size)
        self._num_cached[rid] = num_full

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks. Freeing an unknown request does nothing."""
        table = self._tables.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if table:
            # Tail first: a prompt's last blocks are the least likely to be shared, so under
            # LRU they are evicted before the blocks that start it.
            self.pool.free(table[::-1])
