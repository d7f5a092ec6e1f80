"""KVConnector: the engine's one view of moving KV between replicas. The engine never sees a
transport: it saves a finished prompt's blocks, starts loads into slots it allocated, and
asks which loads ended, loaded or failed.

    prefill replica                                    decode replica
    save(request, blocks) -> Export (pinned)           start_load(load, remote)
    claim / read / release  <- server threads -------  worker: claim, pull (a transport), release
    take_releasable() -> blocks to free                take_finished() -> (request id, loaded)

A pin ends exactly once: released by the decode replica once it has the blocks (or by the
gateway, aborting), or expired `kv_pin_seconds` after the save (a claim holds it for
`kv_pull_timeout_s` more). The decode replica trusts the bytes it copied only if its release
finds the pin still held: an expired pin's blocks may have been reused meanwhile.

A transport moves the blocks of one claimed transfer into this replica's cache (`pull`):
shared memory where the prefill replica's cache can be mapped from here (shm.py), else its
server's stream (http.py). Another (NIXL, Mooncake) is one more KVTransport, chosen from
what the claim's answer offers.

A replica whose model is split over ranks is a group (group.py): each rank's cache holds its
layers' and KV heads' share of every block, in shared memory that the driver maps, so this
connector, on the driver, reads and writes every rank's share itself. A pin is the driver's
alone: its block ids are the same slots on every rank, and the driver's scheduler frees
them. A claim's answer names each rank's part and segment; a decode group of another size
copies each head of each layer from a rank that holds it.

Threads: save, take_releasable, start_load and take_finished run on the engine thread; the
server calls claim, read and release from its own; pulls run in this connector's workers.
The block pool is touched only by the engine thread (it frees what take_releasable gives).
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from ember.config import KVTransferConfig
from ember.kernels import CpuKernels
from ember.kv.prefix_cache import prompt_block_keys
from ember.kv_transfer.blocks import BlockWriter, copy_blocks, read_blocks
from ember.kv_transfer.group import (RankKV, RankPart, describe_parts, pair_pieces,
                                     parse_parts, staging, unit_nbytes)
from ember.kv_transfer.params import Export, KVFormat, RemotePrefill, TransferFailed
from ember.kv_transfer.shm import Mappings
from ember.request import Request
from ember.scheduler.output import KVLoad

if TYPE_CHECKING:   # imported by decode replicas only (httpx)
    from ember.kv_transfer.http import PrefillClient

log = logging.getLogger(__name__)


class KVTransport(Protocol):
    name: str

    def pull(self, client: PrefillClient, claim: dict, source: list[RankPart],
             pairs: list[tuple[int, int]], deadline: float) -> int | None:
        """Copy the claimed transfer's blocks (remote id, local id) from the prefill
        replica's ranks (`source`: what each holds) into the local group's caches; the bytes
        moved, or None when this transport cannot reach that replica."""


class ShmTransport:
    name = "shm"

    def __init__(self, group: list[RankKV], kernels: CpuKernels | None) -> None:
        self.group = group
        self.kernels = kernels   # the compiled copy, or None for torch's
        self.mappings = Mappings()

    def pull(self, client: PrefillClient, claim: dict, source: list[RankPart],
             pairs: list[tuple[int, int]], deadline: float) -> int | None:
        segments = claim.get("shm")
        if not isinstance(segments, list) or len(segments) != len(source):
            return None
        mapped = [self.mappings.tensors(where) if isinstance(where, dict) else None
                  for where in segments]
        if any(m is None for m in mapped):
            return None
        src = [RankKV(part, tensors) for part, tensors in zip(source, mapped)]
        src_pieces, dst_pieces = pair_pieces(src, self.group)
        if not _same_blocks(src_pieces, dst_pieces):
            return None
        return copy_blocks(src_pieces, dst_pieces, pairs, self.kernels)


class HttpTransport:
    name = "http"

    def __init__(self, group: list[RankKV]) -> None:
        self.group = group

    def pull(self, client: PrefillClient, claim: dict, source: list[RankPart],
             pairs: list[tuple[int, int]], deadline: float) -> int | None:
        """The prefill group's stream, written straight into this group's slots where the
        two groups have one layout; else into staging caches of the prefill group's layout,
        whose pieces are then copied into this group's."""
        same = source == [r.part for r in self.group]
        landing = self.group if same else staging(source, self.group, len(pairs))
        writer = BlockWriter([t for r in landing for t in r.tensors],
                             [d for _, d in pairs] if same else list(range(len(pairs))))
        moved = 0
        for chunk in client.blocks([s for s, _ in pairs]):
            try:
                moved += writer.write([chunk])
            except ValueError as e:
                raise TransferFailed("transfer_failed", str(e)) from e
            if time.monotonic() > deadline:
                raise TransferFailed("timeout", "the pull ran past --kv-pull-timeout")
        if not writer.complete:
            raise TransferFailed("transfer_failed", "the stream ended before its last block")
        if not same:
            src_pieces, dst_pieces = pair_pieces(landing, self.group)
            copy_blocks(src_pieces, dst_pieces, [(i, d) for i, (_, d) in enumerate(pairs)])
        return moved


def _same_blocks(a: list[Tensor], b: list[Tensor]) -> bool:
    """Caches whose blocks have one layout (their block counts aside)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape[:2] == y.shape[:2] and x.shape[3:] == y.shape[3:]
        for x, y in zip(a, b))


@dataclass
class TransferStats:
    """Counters for the metrics (read from any thread; changed under the connector's lock)."""

    num_exports: int = 0
    pinned_blocks: int = 0
    releases: dict[str, int] = field(default_factory=dict)    # pulled/released/expired/...
    bytes_served: int = 0          # streamed to decode replicas (HTTP)
    num_loads: int = 0             # pulls that loaded
    bytes_loaded: dict[str, int] = field(default_factory=dict)   # by transport
    seconds_loading: float = 0.0
    blocks_loaded: int = 0
    blocks_skipped: int = 0        # held by this replica's prefix cache: not pulled
    fallbacks: dict[str, int] = field(default_factory=dict)  # prompts computed here, by reason

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


@dataclass
class _Pin:
    export: Export
    deadline: float    # unix time


class KVConnector:
    def __init__(self, config: KVTransferConfig, group: list[RankKV], kv_format: KVFormat,
                 segments: list[dict] | None = None, kernels: CpuKernels | None = None) -> None:
        """`group`: this replica's ranks' caches (group.py; one for a one-process replica);
        `segments`: where other processes on this host map each rank's cache
        (SharedKV.describe, rank by rank), or None where they cannot."""
        self.config = config
        self.group = group
        self.tensors = [t for r in group for t in r.tensors]   # the group's, rank by rank
        self.kv_format = kv_format
        self.segments = segments
        self.replica_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.on_ready: Callable[[], None] = lambda: None   # wakes the engine thread
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._pins: dict[str, _Pin] = {}
        self._unpinned: list[tuple[int, ...]] = []    # blocks for the engine thread to free
        self._finished: list[tuple[str, bool]] = []
        self._transports: list[KVTransport] = [HttpTransport(group)]
        if config.kv_transport == "auto":
            self._transports.insert(0, ShmTransport(group, kernels))
        self._workers = self._http = None
        if config.imports:
            from ember.kv_transfer import http
            self._workers = ThreadPoolExecutor(2, "ember-kv")
            self._http = http.make_http_client(config.kv_pull_timeout_s)
            self._client = http.PrefillClient

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)
            self._http.close()

    # -- the prefill replica ---------------------------------------------------------------

    def save(self, request: Request, block_ids: list[int]) -> Export:
        """Pin a finished prompt's blocks for a decode replica (engine thread)."""
        export = Export(secrets.token_hex(12), self.replica_id, tuple(block_ids),
                        tuple(prompt_block_keys(request.prompt_token_ids,
                                                self.kv_format.block_size,
                                                request.cache_salt)),
                        request.num_prompt_tokens, request.output_token_ids[0],
                        request.num_cached_tokens,
                        time.time() + self.config.kv_pin_seconds, self.kv_format)
        with self._lock:
            self._pins[export.transfer_id] = _Pin(export, export.expires_at)
            self.stats.num_exports += 1
            self.stats.pinned_blocks += len(block_ids)
        return export

    def claim(self, transfer_id: str) -> dict | None:
        """Hold a pin for a pull (`kv_pull_timeout_s` more); where its blocks can be read.
        None when it is not pinned (never, or no longer)."""
        with self._lock:
            pin = self._pins.get(transfer_id)
            if pin is None:
                return None
            pin.deadline = max(pin.deadline, time.time() + self.config.kv_pull_timeout_s)
        return {"shm": self.segments, "parts": describe_parts(self.group),
                "unit_nbytes": unit_nbytes(self.group)}

    def read(self, transfer_id: str, block_ids: list[int]) -> Iterator[bytes] | None:
        """The stream of a pinned transfer's blocks `block_ids` (blocks.py); None when it is
        not pinned or they are not its blocks."""
        with self._lock:
            pin = self._pins.get(transfer_id)
            if pin is None or not set(block_ids) <= set(pin.export.block_ids):
                return None
        return self._count_served(read_blocks(self.tensors, block_ids))

    def _count_served(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            with self._lock:
                self.stats.bytes_served += len(chunk)
            yield chunk

    def release(self, transfer_id: str, reason: str = "released") -> bool:
        """Unpin a transfer (any thread); False when it was not pinned."""
        with self._lock:
            pin = self._pins.pop(transfer_id, None)
            if pin is None:
                return False
            self._unpin(pin, reason)
        self.on_ready()
        return True

    def _unpin(self, pin: _Pin, reason: str) -> None:
        self._unpinned.append(pin.export.block_ids)
        self.stats.pinned_blocks -= len(pin.export.block_ids)
        self.stats.count(self.stats.releases, reason)

    def take_releasable(self, now: float | None = None) -> list[tuple[int, ...]]:
        """Blocks of pins released, or expired by `now`, for the engine thread to free."""
        now = time.time() if now is None else now
        with self._lock:
            for transfer_id in [t for t, p in self._pins.items() if p.deadline <= now]:
                self._unpin(self._pins.pop(transfer_id), "expired")
            unpinned, self._unpinned = self._unpinned, []
        return unpinned

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def snapshot(self) -> TransferStats:
        """A copy of the counters (any thread)."""
        with self._lock:
            s = self.stats
            return replace(s, releases=dict(s.releases), bytes_loaded=dict(s.bytes_loaded),
                           fallbacks=dict(s.fallbacks))

    # -- the decode replica ----------------------------------------------------------------

    def start_load(self, load: KVLoad, remote: RemotePrefill) -> None:
        """Pull the blocks of `load` that this replica lacks, in a worker (engine thread).
        A load with nothing to pull only releases the pin."""
        with self._lock:
            self.stats.blocks_skipped += load.first_block
        if load.first_block >= len(load.block_ids):
            self._workers.submit(self._release_remote, remote)
            return
        self._workers.submit(self._pull, load, remote)

    def take_finished(self) -> list[tuple[str, bool]]:
        """(request id, loaded) of the pulls that ended; their workers are done with the
        blocks (engine thread)."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def fallback(self, remote: RemotePrefill, reason: str, request_id: str) -> None:
        """A prompt computed here instead of pulled (counted, logged); the prefill
        replica's pin is released in the background."""
        self._count_fallback(reason, request_id, remote)
        self.abandon(remote)

    def abandon(self, remote: RemotePrefill) -> None:
        """Release a prefill replica's pin that no pull will take (in the background)."""
        self._workers.submit(self._release_remote, remote)

    def _count_fallback(self, reason: str, request_id: str, remote: RemotePrefill) -> None:
        log.warning("request %s computes its prompt here: %s (prefill replica %s)",
                    request_id, reason, remote.url)
        with self._lock:
            self.stats.count(self.stats.fallbacks, reason)

    def _release_remote(self, remote: RemotePrefill) -> None:
        client = self._client(self._http, remote.url, remote.export.transfer_id,
                               remote.authorization)
        try:
            client.release()
        except TransferFailed:
            pass   # gone, or expired: either way it holds nothing now

    def _pull(self, load: KVLoad, remote: RemotePrefill) -> None:
        start = time.monotonic()
        export = remote.export
        pairs = [(export.block_ids[i], load.block_ids[i])
                 for i in range(load.first_block, len(load.block_ids))]
        client = self._client(self._http, remote.url, export.transfer_id, remote.authorization)
        loaded = False
        try:
            claim = client.claim()
            moved, transport = self._move(client, claim, pairs,
                                          start + self.config.kv_pull_timeout_s)
            client.release()
            loaded = True
            with self._lock:
                self.stats.num_loads += 1
                self.stats.count(self.stats.bytes_loaded, transport, moved)
                self.stats.seconds_loading += time.monotonic() - start
                self.stats.blocks_loaded += len(pairs)
        except TransferFailed as e:
            self._count_fallback(e.reason, load.request_id, remote)
            if e.reason == "unreachable":
                for transport in self._transports:
                    if isinstance(transport, ShmTransport):
                        transport.mappings.forget_gone()
            elif e.reason != "expired":
                self._try_release(client)
        except Exception:  # noqa: BLE001 - a pull's failure is that request's alone
            log.exception("request %s: pulling its KV failed", load.request_id)
            self._count_fallback("transfer_failed", load.request_id, remote)
            self._try_release(client)
        finally:
            with self._lock:
                self._finished.append((load.request_id, loaded))
            self.on_ready()

    def _move(self, client: PrefillClient, claim: dict, pairs: list[tuple[int, int]],
              deadline: float) -> tuple[int, str]:
        if claim.get("unit_nbytes") != unit_nbytes(self.group):
            raise TransferFailed("incompatible", "the two replicas' blocks differ in size")
        source = parse_parts(claim.get("parts"))   # any layout pairs up with ours: group.py
        for transport in self._transports:
            moved = transport.pull(client, claim, source, pairs, deadline)
            if moved is not None:
                return moved, transport.name
        raise TransferFailed("unreachable", "no transport reaches the prefill replica")

    @staticmethod
    def _try_release(client: PrefillClient) -> None:
        try:
            client.release()
        except TransferFailed:
            pass

