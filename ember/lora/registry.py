"""The adapters a server knows, and the few it holds in memory.

Registered adapters (at start, or loaded at run time) are known by name; at most `max_loras`
of them are resident (their factors in CPU memory), least recently used out first. An evicted
adapter is read from its file again when a request names it. An adapter that a queued or
running request uses (`in_use`, which the engine provides) is never evicted: when every
resident one is in use, a request for another is refused with Overloaded (retry once some
finish). Any thread may call these.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ember.config import ModelConfig
from ember.errors import AdapterNotFound, ConfigError, Overloaded
from ember.lora.adapter import MAX_LORA_RANK, LoraAdapter, load_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    uid: int
    digest: str   # of the files last read (adapter.py): the salt of its prefix-cache blocks


class LoraRegistry:
    def __init__(self, config: ModelConfig, max_loras: int = 8,
                 max_rank: int = MAX_LORA_RANK,
                 on_evict: Callable[[int], None] | None = None) -> None:
        if max_loras < 1:
            raise ConfigError(f"max_loras={max_loras} must be at least 1")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.on_evict = on_evict   # told the uid of each adapter that leaves memory
        self._known: dict[str, AdapterInfo] = {}
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._uids = itertools.count(1)
        self._lock = threading.RLock()
        # the adapters of queued and running requests (the engine sets it)
        self.in_use: Callable[[], frozenset[str]] = frozenset

    def names(self) -> list[str]:
        with self._lock:
            return list(self._known)

    def digests(self) -> dict[str, str]:
        """Each adapter's digest, by name (what /v1/models shows a router)."""
        with self._lock:
            return {name: info.digest for name, info in self._known.items()}

    def resident_names(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._known

    def add(self, name: str, path: str | Path) -> AdapterInfo:
        """Read and register an adapter (replacing one of the same name); it is resident
        afterwards. Raises ConfigError when the file is not a LoRA for this model."""
        if not name or name != name.strip():
            raise ConfigError(f"LoRA adapter name {name!r} must be non-empty, without spaces "
                              "around it")
        uid = next(self._uids)
        adapter = load_adapter(name, path, self.config, uid, self.max_rank)  # outside the lock
        with self._lock:
            old = self._resident.pop(name, None)
            if old is not None and self.on_evict is not None:
                self.on_evict(old.uid)
            self._known[name] = AdapterInfo(name, adapter.path, uid, adapter.digest)
            self._make_room(self.in_use() - {name})
            self._resident[name] = adapter
        log.info("LoRA adapter %s loaded from %s (rank %d, %.1f MiB)", name, adapter.path,
                 adapter.rank, adapter.num_bytes / 2**20)
        return self._known[name]

    def remove(self, name: str) -> None:
        """Forget an adapter. Requests already using it finish with it; its memory goes when
        the last of them does (the next eviction sweep)."""
        with self._lock:
            if name not in self._known:
                raise AdapterNotFound(f"no LoRA adapter named {name!r} is loaded; loaded: "
                                     f"{', '.join(self._known) or 'none'}", param="lora_name")
            del self._known[name]
            if name not in self.in_use():
                self._evict(name)

    def acquire(self, name: str) -> LoraAdapter:
        """The adapter, resident (read again from its file if it was evicted)."""
        with self._lock:
            info = self._known.get(name)
            if info is None:
                raise AdapterNotFound(f"the model {name!r} is neither the served model nor a "
                                     f"loaded LoRA adapter; adapters: "
                                     f"{', '.join(self._known) or 'none'}", param="model")
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
                return adapter
            self._make_room(self.in_use())
            adapter = load_adapter(name, info.path, self.config, info.uid, self.max_rank)
            self._resident[name] = adapter
            # a file changed since it was added salts its new blocks apart from the old
            self._known[name] = AdapterInfo(name, info.path, info.uid, adapter.digest)
            return adapter

    def _make_room(self, in_use: frozenset[str]) -> None:
        """Evict until one more adapter fits, least recently used first, never one in use."""
        for name in [n for n in self._resident if n not in self._known and n not in in_use]:
            self._evict(name)
        while len(self._resident) >= self.max_loras:
            idle = [n for n in self._resident if n not in in_use]
            if not idle:
                raise Overloaded(f"all {self.max_loras} resident LoRA adapters are in use by "
                                 "running requests; retry shortly, or raise --max-loras")
            self._evict(idle[0])

    def _evict(self, name: str) -> None:
        adapter = self._resident.pop(name, None)
        if adapter is not None and self.on_evict is not None:
            self.on_evict(adapter.uid)
