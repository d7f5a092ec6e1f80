"""Which prefix blocks each replica holds, as far as the gateway can tell.

Two sources, per replica:
* its `/kv/events` log (ember/server/kv_events.py): a snapshot of every block it holds on
  first contact, then the events after the snapshot's cursor, polled: blocks stored and
  removed, under the chained keys of ember/kv/prefix_cache.py. A gap in the log ("dropped"),
  or a replica that was down (it may have restarted, numbering from 0), means a new snapshot.
  The keys are those of the model the replica names ("model"); the gateway uses them only
  for the model its own tokenizer is for (fleet.py).
* the blocks the gateway just routed to it, kept for a TTL: the replica stores them only once
  it has prefilled them, and the next poll is later still, so without these a burst of one
  prefix would be spread over every replica before the first event arrives.

A replica without KV events (any OpenAI-compatible server) gets an approximate prefix tree
of the text routed to it instead: chained hashes of fixed-size character chunks.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any


class BlockIndex:
    """One replica's cached block keys, from its events and from recent routing."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.routed: dict[int, float] = {}   # key -> expiry (monotonic seconds)
        self.cursor = -1                      # the last event seq applied
        self.synced = False                   # False: the next poll asks for a snapshot
        self.block_size: int | None = None
        self.model: str | None = None         # the served model the replica's keys are for
        self.resyncs = 0

    def reset(self) -> None:
        """Forget the blocks (the replica restarted, or the log has a gap): the next poll
        takes a snapshot."""
        self.blocks.clear()
        self.cursor = -1
        self.synced = False
        self.resyncs += 1

    def query(self) -> str:
        """The next poll's query string."""
        return f"after={self.cursor}" if self.synced else "snapshot=1"

    def apply(self, payload: dict[str, Any]) -> bool:
        """Apply one `/kv/events` answer: a snapshot, or the events after the cursor. False
        if it asks for a new snapshot."""
        self.block_size = payload.get("block_size", self.block_size)
        self.model = payload.get("model", self.model)
        if "snapshot" in payload:
            self.blocks = {block["block_hash"] for block in payload["snapshot"]}
            self.cursor, self.synced = payload["cursor"], True
            return True
        if payload.get("dropped") and self.synced:
            self.reset()
            return False
        # unsynced, events: a server without snapshots, read from its oldest event
        self.synced = True
        for event in payload.get("events", []):
            if event["type"] == "stored":
                self.blocks.add(event["block_hash"])
            else:
                self.blocks.discard(event["block_hash"])
            self.cursor = event["seq"]
        return True

    def note_routed(self, keys: list[int], expiry: float) -> None:
        for key in keys:
            self.routed[key] = expiry

    def matched(self, keys: list[int], now: float) -> int:
        """How many leading blocks of `keys` this replica holds (or was just sent)."""
        count = 0
        for key in keys:
            if key in self.blocks or self.routed.get(key, 0.0) > now:
                count += 1
            else:
                break
        return count

    def expire(self, now: float) -> None:
        stale = [k for k, t in self.routed.items() if t <= now]
        for key in stale:
            del self.routed[key]


def text_keys(text: str, chunk_chars: int) -> list[int]:
    """Chained 64-bit hashes of `text`'s whole chunks of `chunk_chars` characters."""
    keys: list[int] = []
    parent = b""
    for i in range(len(text) // chunk_chars):
        h = hashlib.blake2b(parent + text[i * chunk_chars:(i + 1) * chunk_chars].encode(),
                            digest_size=8)
        parent = h.digest()
        keys.append(int.from_bytes(parent, "little"))
    return keys


class TextIndex:
    """The approximate prefix tree of the text routed to one replica: a node per chunk key,
    the oldest forgotten first past `max_chunks` (the replica's own cache evicts too)."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self.nodes: OrderedDict[int, None] = OrderedDict()

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.nodes[key] = None
            self.nodes.move_to_end(key)
        while len(self.nodes) > self.max_chunks:
            self.nodes.popitem(last=False)

    def matched(self, keys: list[int]) -> int:
        count = 0
        for key in keys:
            if key not in self.nodes:
                break
            count += 1
        return count
