"""A KV cache's blocks as bytes: copied between two caches of one layout, or streamed.

A cache is every layer's PagedKV (models/attention.py); its tensors are each layer's data
[2, kv_heads, num_blocks, block_size, head_dim] and, for int8, scale [2, kv_heads,
num_blocks, block_size]. Block b of a tensor is t[:, :, b]: 2 * kv_heads strided pieces.
Blocks move as stored (int8 values with their float16 scales), never converted.

The stream of a list of blocks is groups of up to GROUP blocks in order; a group is, tensor
after tensor, t.index_select(2, group's block ids) as raw bytes:

    group 0: t0[:, :, g0] | t1[:, :, g0] | ...   group 1: t0[:, :, g1] | ...
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from ember.kernels import CpuKernels
from ember.models.attention import PagedKV

GROUP = 16   # blocks read or written per torch op on the streamed path
# runs of adjacent blocks this long on average, or longer, are copied run by run; shorter
# ones through a gathered copy (measured: run by run is ahead from 4 blocks a run, behind
# at 1 or 2; docs/disaggregated.md)
MIN_MEAN_RUN = 3


def cache_tensors(caches: list[PagedKV]) -> list[Tensor]:
    """Every tensor of the cache, in a fixed order: layer by layer, data then scale."""
    return [t for kv in caches for t in (kv.data, kv.scale) if t is not None]


def block_nbytes(tensors: list[Tensor]) -> int:
    """Bytes of one block in all the tensors."""
    return sum(t[:, :, 0].numel() * t.element_size() for t in tensors)


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src start, dst start, length) runs of pairs where both
    sides are consecutive: one copy each."""
    out: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            s, d, n = out[-1]
            out[-1] = (s, d, n + 1)
        else:
            out.append((src, dst, 1))
    return out


@torch.inference_mode()
def copy_blocks(src: list[Tensor], dst: list[Tensor], pairs: list[tuple[int, int]],
                kernels: CpuKernels | None = None) -> int:
    """Copy blocks src[s] -> dst[d] for each (s, d) pair, between two caches of the same
    layout but for their block counts. Returns the bytes copied.

    With `kernels`, one call does every piece of every run (kv_copy.cpp), the GIL
    released. On the torch path, runs of adjacent blocks copy in one pass, a run per torch
    op; blocks scattered on either side go through a gathered copy (two passes, but two ops
    per tensor instead of one per block: a block's pieces are small, and per-op overhead
    would dominate)."""
    spans = runs(pairs)
    if kernels is not None:
        return kernels.copy_kv_blocks(src, dst, torch.tensor(spans, dtype=torch.long)
                                      .view(-1, 3))
    if len(spans) * MIN_MEAN_RUN <= len(pairs):
        for s, d, n in spans:
            for a, b in zip(src, dst):
                b[:, :, d:d + n].copy_(a[:, :, s:s + n])
    else:
        src_index = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst_index = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for a, b in zip(src, dst):
            _by_block(b).index_copy_(1, dst_index, _by_block(a).index_select(1, src_index))
    return len(pairs) * block_nbytes(dst)


def _by_block(t: Tensor) -> Tensor:
    """[2, kv_heads, num_blocks, ...] -> [2 * kv_heads, num_blocks, one block's values]."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2], -1)


@torch.inference_mode()
def read_blocks(tensors: list[Tensor], block_ids: list[int]) -> Iterator[bytes]:
    """The stream of `block_ids` (the module doc): one bytes object per group."""
    for start in range(0, len(block_ids), GROUP):
        index = torch.tensor(block_ids[start:start + GROUP], dtype=torch.long)
        yield b"".join(_raw(t.index_select(2, index)) for t in tensors)


def _raw(t: Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class BlockWriter:
    """Writes a stream of blocks (read_blocks) into `tensors` at `block_ids`, in whatever
    pieces the bytes arrive."""

    def __init__(self, tensors: list[Tensor], block_ids: list[int]) -> None:
        self.tensors = tensors
        self.block_ids = block_ids
        self.block_nbytes = block_nbytes(tensors)
        self._pending = bytearray()
        self._done = 0   # blocks written

    @property
    def complete(self) -> bool:
        return self._done == len(self.block_ids) and not self._pending

    def write(self, chunks: Iterable[bytes]) -> int:
        """Take in the next pieces of the stream; returns the bytes taken. Raises
        ValueError on bytes past the last block."""
        taken = 0
        for chunk in chunks:
            taken += len(chunk)
            self._pending += chunk
            self._flush()
        return taken

    @torch.inference_mode()
    def _flush(self) -> None:
        while self._done < len(self.block_ids):
            ids = self.block_ids[self._done:self._done + GROUP]
            size = len(ids) * self.block_nbytes
            if len(self._pending) < size:
                return
            group, self._pending = self._pending[:size], self._pending[size:]
            raw = torch.frombuffer(group, dtype=torch.uint8)
            index = torch.tensor(ids, dtype=torch.long)
            offset = 0
            for t in self.tensors:
                shape = (*t.shape[:2], len(ids), *t.shape[3:])
                n = t[:, :, :len(ids)].numel() * t.element_size()
                t.index_copy_(2, index, raw[offset:offset + n].view(t.dtype).view(shape))
                offset += n
            self._done += len(ids)
        if self._pending:
            raise ValueError(f"{len(self._pending)} bytes arrived past the last block")
