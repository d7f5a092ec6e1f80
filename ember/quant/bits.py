"""Bit unpacking and scaling shared by the GGUF block formats (ember.quant.formats, .kquants).

The kernels write their float32 result into a caller's buffer (`out`) and allocate only small
uint8 intermediates: fresh float32 temporaries of a whole chunk cost more in page faults than
the arithmetic itself (each is a new mapping the allocator hands back to the OS when freed).
"""
from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

# outputs this large are backed by transparent huge pages where the OS offers them
HUGE_PAGE_BYTES = 2 << 20


def f16(raw: Tensor) -> Tensor:
    """[n, 2] uint8 -> [n] float32 (little-endian half floats)."""
    return raw.contiguous().view(torch.float16)[:, 0].float()


def shifted(raw: Tensor, shifts: tuple[int, ...], mask: int) -> Tensor:
    """raw [..., k] uint8 -> [..., len(shifts), k] uint8: (raw >> s) & mask for each shift s
    (a negative s shifts left).

    Most ggml formats store a run of k values per shift: a byte's low nibble is value j and
    its high nibble value j + k, or its bit pairs values j, j + k, j + 2k, j + 3k.
    One scalar shift per s: torch's shift by a broadcast tensor of shifts is 3-5x slower.
    """
    out = torch.empty(*raw.shape[:-1], len(shifts), raw.shape[-1], dtype=torch.uint8)
    for i, s in enumerate(shifts):
        moved = raw >> s if s > 0 else raw << -s if s < 0 else raw
        torch.bitwise_and(moved, mask, out=out[..., i, :])
    return out


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """torch.empty, but a tensor of 2 MB or more lives in an anonymous mapping advised to use
    huge pages (Linux), so the first write to it faults once per 2 MB instead of once per
    4 KB: for a dequantized tensor, 4-12 bytes per byte of GGUF, those faults cost more
    than the dequantizing itself. The tensor keeps the mapping alive."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE)  # shared would be shmem
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def output(out: Tensor | None, num_blocks: int, block_values: int) -> Tensor:
    """The caller's [num_blocks, block_values] float32 buffer, or a new one."""
    if out is None:
        return torch.empty(num_blocks, block_values, dtype=torch.float32)
    return out


def scale_into(out: Tensor, scale: Tensor, q: Tensor, minus: Tensor | None = None,
               plus: Tensor | None = None) -> Tensor:
    """out [n, v] float32 = scale * q - minus + plus, with scale, minus, plus [n, s] float32
    (one per sub-block of v / s values) and q [n, v] small integers (cast exactly to float32
    inside the multiply); the float32 operations in this order, as gguf's numpy code does."""
    n, s = scale.shape
    view = out.view(n, s, -1)
    torch.mul(scale[:, :, None], q.reshape(n, s, -1), out=view)
    if minus is not None:
        view.sub_(minus[:, :, None])
    if plus is not None:
        view.add_(plus[:, :, None])
    return out


def level_pairs(levels: tuple[int, ...]) -> Tensor:
    """A 4-bit code book -> [256] int16: byte b's two levels (levels[b & 15], levels[b >> 4])
    as two int8 lanes, so one look-up decodes both nibbles of a byte."""
    table = torch.tensor(levels, dtype=torch.int8)
    b = torch.arange(256)
    return torch.stack([table[b & 15], table[b >> 4]], dim=1).view(torch.int16)[:, 0]


def lookup_nibbles(pairs: Tensor, raw: Tensor) -> Tensor:
    """pairs from level_pairs, raw [..., k] uint8 -> [..., 2, k] int8: the levels of the low
    nibbles, then of the high ones (a strided view)."""
    idx = raw.reshape(-1).int()
    lanes = torch.index_select(pairs, 0, idx).view(torch.int8).view(*raw.shape, 2)
    return lanes.transpose(-1, -2)
