"""GGUF (ggml) block formats, dequantized in plain torch.

Each format packs rows of weights into blocks of 32 values along the input dimension:

    Q8_0: [d: f16][q: 32 x int8]                 x = d * q
    Q4_0: [d: f16][q: 16 bytes, 2 nibbles each]  x = d * (q - 8)
    Q4_1: [d: f16][m: f16][q: 16 bytes]          x = d * q + m

In a 4-bit block, byte j holds value j in its low nibble and value j + 16 in its high nibble.
Other ggml types (the K-quants, IQ formats) are dequantized by the `gguf` package's numpy code,
which is also the reference these kernels are tested against.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

BLOCK = 32
# bytes per block of 32 values for the formats dequantized here
BLOCK_BYTES = {QType.Q8_0: 34, QType.Q4_0: 18, QType.Q4_1: 20}
PLAIN = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n] float32 (little-endian half floats)."""
    return raw.contiguous().view(torch.float16)[:, 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] uint8 -> [..., 32] int16: low nibbles are values 0-15, high ones 16-31."""
    qs = qs.to(torch.int16)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [n, 34] uint8 -> [n, 32] float32."""
    d = _f16(blocks[:, 0:2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d[:, None] * q


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [n, 18] uint8 -> [n, 32] float32."""
    d = _f16(blocks[:, 0:2])
    return d[:, None] * (_nibbles(blocks[:, 2:]) - 8).float()


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [n, 20] uint8 -> [n, 32] float32."""
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    return d[:, None] * _nibbles(blocks[:, 4:]).float() + m[:, None]


_KERNELS = {QType.Q8_0: dequant_q8_0, QType.Q4_0: dequant_q4_0, QType.Q4_1: dequant_q4_1}


def as_tensor(data: np.ndarray) -> torch.Tensor:
    """A torch view of a (possibly read-only, memory-mapped) numpy array; never written to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(data))


def dequantize(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF tensor bytes -> float tensor of `shape` (rows first, as torch orders them).

    `data` is what gguf.GGUFReader gives: the raw block bytes for quantized types, or the values
    for plain ones. Plain types keep their dtype; the others come back as float32.
    """
    if qtype in PLAIN:
        tensor = as_tensor(data)
        if qtype is QType.BF16 and tensor.dtype != torch.bfloat16:
            tensor = tensor.view(torch.uint8).view(torch.bfloat16)
        return tensor.reshape(shape)
    if qtype in _KERNELS:
        raw = as_tensor(data).view(torch.uint8)
        blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
        return _KERNELS[qtype](blocks).reshape(shape)
    values = gguf_quants.dequantize(np.ascontiguousarray(data), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
