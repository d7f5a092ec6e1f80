"""All-reduce (sum) among the ranks of a tensor-parallel group, added in one fixed order.

Two transports with one result: `shm`, for ranks on one host, through a shared-memory
segment per group (ember/kernels/cpu/shm_allreduce.cpp), and `gloo`, torch.distributed's
gloo backend, across hosts or where shared memory is unavailable. Both add the ranks'
tensors in rank order 0..T-1 in float32 and round once to the tensor's dtype
(sum_in_rank_order), so a run's tokens do not depend on the transport. gloo's own
all_reduce adds in an order of its choosing (and bfloat16 in bfloat16), so the gloo path
all-gathers and adds here.
"""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ember.errors import ConfigError

log = logging.getLogger(__name__)

AllReduceFn = Callable[[Tensor], None]   # in place: x becomes the sum of every rank's x

KINDS = ("auto", "shm", "gloo")
DTYPES = (torch.float32, torch.bfloat16)
SLOT_BYTES = 1 << 20     # per rank and buffer of the segment; a larger tensor goes in chunks
TIMEOUT_S = 300.0        # a rank waits this long for another (an exited one is seen sooner)
SPIN_US = 50.0           # then it stops spinning and yields its core, then sleeps
SHM_DIR = "/dev/shm"


def sum_in_rank_order(parts: Tensor) -> Tensor:
    """parts [T, ...] float32 or bfloat16 -> [...] in their dtype: parts[0] + parts[1] + ...
    added in that order in float32, rounded once (bfloat16: to nearest even). What both
    transports compute, bit for bit."""
    acc = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        acc.add_(part)   # a bfloat16 part is widened exactly, the add is float32
    return acc.to(parts.dtype)


def process_group(group: Any) -> dist.ProcessGroup:
    """`group` itself, or torch.distributed's default group for None. The ProcessGroup's own
    collectives are used, so a group built standalone (not registered with
    torch.distributed, as the tensor-parallel ranks' is) works as well."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized; call "
                          "init_process_group('gloo', ...) before make_all_reduce, or pass "
                          "a process group")
    return dist.group.WORLD


def all_gather(group: dist.ProcessGroup, x: Tensor) -> list[Tensor]:
    """Every rank's `x` (the same shape on every rank), in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.size())]
    group.allgather([parts], [x]).wait()
    return parts


class GlooAllReduce:
    """The all-reduce over torch.distributed (any host layout): all-gather, then add."""

    kind = "gloo"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, x: Tensor) -> None:
        check_tensor(x)
        x.copy_(sum_in_rank_order(torch.stack(all_gather(self.group, x.contiguous()))))

    def close(self) -> None:
        """Nothing to release: the process group is the caller's."""


class ShmAllReduce:
    """The all-reduce through one shared-memory segment (every rank on this host)."""

    kind = "shm"

    def __init__(self, handle: Any, timeout_s: float, spin_us: float, slot_bytes: int) -> None:
        self.handle, self.timeout_s, self.spin_us = handle, timeout_s, spin_us
        self.slot_bytes = slot_bytes

    def __call__(self, x: Tensor) -> None:
        # the kernel checks x itself (a RuntimeError): a check here costs a decode step's
        # all-reduce a third of its time
        self.handle.all_reduce(x, self.timeout_s, self.spin_us)

    def close(self) -> None:
        """Leave the group now (the others' waits on this rank raise at once)."""
        self.handle.close()


def check_tensor(x: Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in DTYPES or not x.is_contiguous():
        raise TypeError(f"all-reduce takes a contiguous float32 or bfloat16 CPU tensor, not "
                        f"{x.dtype} on {x.device} (contiguous: {x.is_contiguous()})")


def make_all_reduce(group: Any, rank: int, world_size: int, kind: str = "auto", *,
                    slot_bytes: int = SLOT_BYTES, timeout_s: float = TIMEOUT_S,
                    spin_us: float = SPIN_US) -> GlooAllReduce | ShmAllReduce:
    """The all-reduce of `group` (a torch.distributed process group, None for the default
    one) for this process, its rank `rank` of `world_size`. Every rank calls this together,
    with the same arguments but rank, and then all-reduces the same shapes in the same order.
    kind "shm": through shared memory (every rank on one host; raises ConfigError where it
    cannot run); "gloo": over the process group; "auto": shm where every rank is on one host
    and shared memory works, else gloo (logged). The result is an AllReduceFn (with `kind`
    and close())."""
    group = process_group(group)
    check_args(group, rank, world_size, kind, slot_bytes, timeout_s, spin_us)
    if kind == "gloo":
        return GlooAllReduce(group)
    handle, why_not = open_shm(group, rank, world_size, slot_bytes)
    if handle is not None:
        return ShmAllReduce(handle, timeout_s, spin_us, slot_bytes)
    if kind == "shm":
        raise ConfigError(f"the shared-memory all-reduce cannot run here: {why_not}; use "
                          "kind 'auto' or 'gloo'")
    log.log(logging.INFO if why_not.startswith("the ranks are on") else logging.WARNING,
            "all-reduce over gloo, not shared memory: %s", why_not)
    return GlooAllReduce(group)


def check_args(group: Any, rank: int, world_size: int, kind: str, slot_bytes: int,
               timeout_s: float, spin_us: float) -> None:
    if kind not in KINDS:
        raise ConfigError(f"all-reduce kind {kind!r} is not one of {', '.join(KINDS)}")
    if (group.rank(), group.size()) != (rank, world_size):
        raise ConfigError(f"rank {rank} of {world_size} does not match the group's rank "
                          f"{group.rank()} of {group.size()}")
    if slot_bytes < 64 or slot_bytes % 64 or slot_bytes > 1 << 31:
        raise ConfigError(f"slot_bytes={slot_bytes} must be a multiple of 64 in [64, 2^31]")
    if not timeout_s > 0 or not spin_us >= 0:
        raise ConfigError(f"timeout_s={timeout_s} must be > 0 and spin_us={spin_us} >= 0")


def segment_bytes(world_size: int, slot_bytes: int) -> int:
    """The shared-memory segment's size (shm_allreduce.cpp's layout): a 64-byte header, a
    64-byte state per rank, two slots per rank."""
    return 64 + world_size * (64 + 2 * slot_bytes)


def open_shm(group: Any, rank: int, world_size: int, slot_bytes: int) -> tuple[Any, str]:
    """(this rank's end of a new shared-memory all-reduce, "") or (None, why not), the same
    answer on every rank. Collective: rank 0 creates the segment, the others open it, and
    rank 0 removes its name once all have it mapped, so that it dies with the processes."""
    kernels, problem = local_shm_support(world_size, slot_bytes)
    infos = gather(group, (socket.gethostname(), problem, secrets.token_hex(8)))
    if len({host for host, _, _ in infos}) > 1:
        return None, f"the ranks are on {len({host for host, _, _ in infos})} hosts"
    problems = [f"rank {r}: {p}" for r, (_, p, _) in enumerate(infos) if p]
    if problems:
        return None, "; ".join(problems)
    name = f"/ember-ar-{infos[0][2]}"
    handle, error = (open_segment(kernels, name, rank, world_size, slot_bytes, create=True)
                     if rank == 0 else (None, ""))
    created = gather(group, error)[0]
    if created:
        return None, f"rank 0: {created}"
    try:
        if rank != 0:
            handle, error = open_segment(kernels, name, rank, world_size, slot_bytes,
                                         create=False)
        errors = gather(group, error)
    finally:
        if rank == 0:
            kernels.shm_unlink(name)
    if any(errors):
        if handle is not None:
            handle.close()
        return None, next(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    return handle, ""


def open_segment(kernels: Any, name: str, rank: int, world_size: int, slot_bytes: int,
                 create: bool) -> tuple[Any, str]:
    """(this rank's end of the segment `name`, "") or (None, the error)."""
    try:
        return kernels.shm_all_reduce(name, rank, world_size, slot_bytes, create), ""
    except RuntimeError as e:
        return None, str(e).splitlines()[0]


def local_shm_support(world_size: int, slot_bytes: int) -> tuple[Any, str]:
    """(the compiled kernels, "") where this process can run the shared-memory all-reduce,
    else (kernels or None, why not)."""
    from ember.kernels import CpuKernels, build_cpu_ops
    try:
        kernels = CpuKernels(build_cpu_ops())
    except Exception as e:  # noqa: BLE001 (no compiler, no headers: gloo still runs)
        first = str(e).splitlines()[0] if str(e) else ""
        return None, (f"the compiled kernels could not be built ({type(e).__name__}: {first}); "
                      "install a C++ compiler (g++) and the Python headers")
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return kernels, f"{SHM_DIR} is not a writable folder"
    stats = os.statvfs(SHM_DIR)
    need = segment_bytes(world_size, slot_bytes)
    if stats.f_bavail * stats.f_frsize < need:
        return kernels, (f"{SHM_DIR} has {stats.f_bavail * stats.f_frsize >> 20} MiB free and "
                         f"the segment needs {need >> 20} MiB; lower slot_bytes or give "
                         f"{SHM_DIR} more room (docker: --shm-size)")
    return kernels, ""


def gather(group: dist.ProcessGroup, obj: Any) -> list[Any]:
    """Every rank's `obj` (pickled), in rank order (a collective: every rank calls it)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = all_gather(group, torch.tensor([len(data)], dtype=torch.int64))
    padded = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return [pickle.loads(part[:int(size)].numpy().tobytes())
            for part, size in zip(all_gather(group, padded), sizes)]


__all__ = ["AllReduceFn", "GlooAllReduce", "KINDS", "ShmAllReduce", "make_all_reduce",
           "sum_in_rank_order"]
