"""Which cached block to give up when the pool runs out of empty ones.

Only blocks that hold a cached prefix and that no request is using are candidates; empty
blocks are always used first. Each policy sees the same facts about a candidate:

  hits      how many requests have reused the block since it was cached
  depth     its position in the prefix chain (block 0 starts a prompt)
  released  a logical clock value: when its last user let it go

  lru   evict the least recently released (ties cannot happen: the clock is strict)
  lfu   evict the least reused; among equals, the least recently released
  cost  GreedyDual-Size-Frequency: a block is worth  L + (hits + 1) * (depth + 1),  where
        (depth + 1) stands for the prefill work to recompute it (its tokens attend over all
        the blocks before it) and L is the worth of the last evicted block, so that blocks
        reused long ago age out. Evict the least worth; ties go to the least recently released.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

POLICIES = ("lru", "lfu", "cost")


@dataclass
class Candidate:
    hits: int
    depth: int
    released: int


class LRU:
    """A heap on the release clock, with lazy deletion (a candidate may enter late, when its
    last cached child goes, and must still be ordered by when it was released). Stale entries
    are dropped once they outnumber the live ones, so the heap stays within twice the
    candidates (plus a few) however often blocks are reused."""

    name = "lru"

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []
        self._live: dict[int, int] = {}  # block -> released

    def __len__(self) -> int:
        return len(self._live)

    def insert(self, block_id: int, candidate: Candidate) -> None:
        self._live[block_id] = candidate.released
        heapq.heappush(self._heap, (candidate.released, block_id))

    def remove(self, block_id: int) -> None:
        del self._live[block_id]
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live entries once it is mostly stale: amortized O(1)."""
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = [(released, b) for b, released in self._live.items()]
            heapq.heapify(self._heap)

    def pop(self) -> int:
        while True:
            released, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == released:
                del self._live[block_id]
                return block_id


class _ScoredPolicy:
    """Evicts the candidate with the smallest score (a linear scan: pools hold thousands of
    blocks, and evictions happen at most a few times per step)."""

    def __init__(self) -> None:
        self._candidates: dict[int, Candidate] = {}

    def __len__(self) -> int:
        return len(self._candidates)

    def insert(self, block_id: int, candidate: Candidate) -> None:
        self._candidates[block_id] = candidate

    def remove(self, block_id: int) -> None:
        del self._candidates[block_id]

    def score(self, candidate: Candidate) -> tuple:
        raise NotImplementedError

    def pop(self) -> int:
        block_id = min(self._candidates, key=lambda b: self.score(self._candidates[b]))
        del self._candidates[block_id]
        return block_id


class LFU(_ScoredPolicy):
    name = "lfu"

    def score(self, c: Candidate) -> tuple:
        return (c.hits, c.released)


class CostAware(_ScoredPolicy):
    name = "cost"

    def __init__(self) -> None:
        super().__init__()
        self._inflation = 0.0   # L: the worth of the last evicted block
        self._worth: dict[int, float] = {}

    def insert(self, block_id: int, candidate: Candidate) -> None:
        super().insert(block_id, candidate)
        self._worth[block_id] = self._inflation + (candidate.hits + 1) * (candidate.depth + 1)

    def remove(self, block_id: int) -> None:
        super().remove(block_id)
        del self._worth[block_id]

    def pop(self) -> int:
        block_id = min(self._candidates,
                       key=lambda b: (self._worth[b], self._candidates[b].released))
        del self._candidates[block_id]
        self._inflation = self._worth.pop(block_id)
        return block_id


def make_policy(name: str) -> LRU | LFU | CostAware:
    policies = {"lru": LRU, "lfu": LFU, "cost": CostAware}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return policies[name]()
