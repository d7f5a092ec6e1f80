"""A pool of fixed-size KV blocks with reference counts.

A block is `block_size` token slots in every layer's KV tensor; the pool hands out block ids
and takes them back. Reference counts let a block be shared (prefix caching builds on this).
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # oldest freed first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num: int) -> list[int]:
        """Take `num` free blocks (ref count 1 each). The caller checks num_free_blocks first."""
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} blocks with {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} is free; it cannot be shared")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the pool."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
