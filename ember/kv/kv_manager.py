"""Per-request block tables: the only view of KV memory the scheduler sees."""
from __future__ import annotations

from ember.kv.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the blocks that hold its tokens' K and V.

    Token i of a request lives in block `table[i // block_size]`, slot `i % block_size`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

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

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover its first `num_tokens` tokens.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        table = self._tables.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table)
        if num_new_blocks <= 0:
            return True
        if num_new_blocks > self.pool.num_free_blocks:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(num_new_blocks))
        return True

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks. Freeing an unknown request does nothing."""
        table = self._tables.pop(request_id, None)
        if table:
            # Free from the tail: the blocks a request took last are the least likely to be
            # shared, so they return to the pool first (matters once prefix caching reuses them).
            self.pool.free(table[::-1])
