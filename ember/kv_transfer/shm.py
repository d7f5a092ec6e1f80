"""A prefill replica's KV cache in shared memory, which a decode replica on the same host maps
and copies blocks out of: one copy from cache to cache, with no bytes through a socket.

The cache lives in an anonymous memory file (memfd_create) that only the prefill process
holds open: another process of the same user maps it through /proc/PID/fd/FD, and the
memory goes back to the system when the last process that maps it is gone (nothing is left
behind in /dev/shm by a replica that is killed). The file's pages are 4 KiB ones (tmpfs
takes no transparent huge pages unless the host's shmem_enabled allows them), which the
prompt chunks a prefill replica computes hardly notice.
"""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ember.config import ModelConfig
from ember.kv_transfer.blocks import cache_tensors
from ember.models.attention import PagedKV
from ember.runner.kv_tensors import allocate_kv_caches

ALIGN = 1 << 12   # each tensor starts on a page
MAX_MAPPINGS = 16  # other ranks' caches a decode replica keeps mapped (a few groups')


def boot_id() -> str:
    """This host's boot: two processes that read the same one share /proc and memory."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class TensorPlace:
    offset: int
    shape: tuple[int, ...]
    dtype: str   # torch's name without "torch."


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _views(buffer: mmap.mmap, places: list[TensorPlace]) -> list[Tensor]:
    views = []
    for p in places:
        dtype = _dtype(p.dtype)
        count = _numel(p.shape) * torch.tensor([], dtype=dtype).element_size()
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=p.offset)
        views.append(raw.view(dtype).view(p.shape))
    return views


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SharedKV:
    """The prefill replica's side: tensors carved out of one memory file, handed to
    allocate_kv_caches through its `zeros` argument in the order it asks for them."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.places: list[TensorPlace] = []
        offset = 0
        for shape, dtype in shapes:
            self.places.append(TensorPlace(offset, tuple(shape), str(dtype).removeprefix(
                "torch.")))
            nbytes = _numel(tuple(shape)) * torch.tensor([], dtype=dtype).element_size()
            offset += -(-nbytes // ALIGN) * ALIGN
        self.size = offset
        self.fd = os.memfd_create("ember-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)   # zeros, allocated as they are first written
        self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensors = _views(self._map, self.places)
        self._handed = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Tensor:
        """The next tensor, which must be of the shape and dtype planned."""
        t = self.tensors[self._handed]
        if tuple(shape) != tuple(t.shape) or dtype != t.dtype or str(device) != "cpu":
            raise RuntimeError(f"the shared KV cache was planned as {t.shape} {t.dtype}, "
                               f"asked for {tuple(shape)} {dtype} on {device}")
        self._handed += 1
        return t

    def describe(self) -> dict:
        """Where another process finds it (a claim's answer; connector.py)."""
        return {"boot_id": boot_id(), "pid": os.getpid(), "fd": self.fd, "size": self.size,
                "tensors": [[p.offset, list(p.shape), p.dtype] for p in self.places]}


class Mappings:
    """The decode replica's side: other replicas' shared caches, mapped read-only (a private
    mapping: reads share the pages, nothing is ever written back), the last few kept."""

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple, tuple[mmap.mmap, list[Tensor]]] = OrderedDict()

    def tensors(self, where: dict) -> list[Tensor] | None:
        """The tensors of the shared cache `where` (SharedKV.describe), or None when it
        cannot be mapped from here (another host, a process gone, no permission)."""
        if where.get("boot_id") != boot_id() or not boot_id():
            return None
        key = (where["pid"], where["fd"], where["size"])
        if key in self._maps:
            self._maps.move_to_end(key)
            return self._maps[key][1]
        try:
            with open(f"/proc/{where['pid']}/fd/{where['fd']}", "rb") as f:
                if os.fstat(f.fileno()).st_size != where["size"]:
                    return None
                buffer = mmap.mmap(f.fileno(), where["size"], access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None
        places = [TensorPlace(o, tuple(s), d) for o, s, d in where["tensors"]]
        self._maps[key] = (buffer, _views(buffer, places))
        while len(self._maps) > MAX_MAPPINGS:
            self._maps.popitem(last=False)
        return self._maps[key][1]

    def forget_gone(self) -> None:
        """Drop the mappings of processes that are gone: their memory is freed with them."""
        for key in [k for k in self._maps if not os.path.exists(f"/proc/{k[0]}")]:
            del self._maps[key]


class GroupSegments:
    """A driver's mappings of its own worker ranks' caches (SharedKV.describe each), read
    and written in place: the driver's connector moves every rank's share of a block. Held
    until the engine closes; the workers' memory outlives them only as long as it does."""

    def __init__(self, segments: list[dict]) -> None:
        self._maps: list[mmap.mmap] = []
        self.tensors: list[list[Tensor]] = []
        for where in segments:
            if where.get("boot_id") != boot_id():
                raise RuntimeError(f"rank (pid {where.get('pid')}) runs on another host: a "
                                   "rank's KV cache must be mapped from the driver")
            with open(f"/proc/{where['pid']}/fd/{where['fd']}", "r+b") as f:
                buffer = mmap.mmap(f.fileno(), where["size"], mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
            self._maps.append(buffer)
            self.tensors.append(_views(buffer, [TensorPlace(o, tuple(shape), d)
                                                for o, shape, d in where["tensors"]]))


def shared_kv_caches(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     kv_cache_dtype: str) -> tuple[list[PagedKV], SharedKV]:
    """allocate_kv_caches' tensors, in one shared memory file."""
    planned = allocate_kv_caches(model, num_blocks, block_size, dtype, "meta", kv_cache_dtype)
    shared = SharedKV([(tuple(t.shape), t.dtype) for t in cache_tensors(planned)])
    return allocate_kv_caches(model, num_blocks, block_size, dtype, "cpu", kv_cache_dtype,
                              zeros=shared.zeros), shared
