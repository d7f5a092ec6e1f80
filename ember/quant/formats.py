"""GGUF (ggml) block formats, dequantized in plain torch.

The formats here pack each row of weights into blocks of 32 values along the input dimension;
the K-quants and IQ4_XS (blocks of 256) are in ember.quant.kquants. Every kernel takes
[n, bytes per block] uint8 and returns [n, values per block] float32, and must equal
`gguf.quants.dequantize` (the reference, tests/reference/test_kquants.py) bit for bit: each
kernel does the reference's float32 operations in the reference's order.

In a 4-bit block, byte j holds value j in its low nibble and value j + 16 in its high nibble.
Types without a kernel here (IQ1-IQ3, TQ, MXFP4) are dequantized by the `gguf` package's
numpy code, which is much slower.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants
from torch import Tensor

from ember.quant import kquants
from ember.quant.bits import (empty_huge, f16, level_pairs, lookup_nibbles, output, scale_into,
                              shifted)
from ember.quant.kquants import IQ4_LEVELS

BLOCK = 32
PLAIN = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
# IQ4_NL's 16 non-linear levels (ggml's kvalues_iq4nl)
# blocks dequantized per step: the intermediates of one step stay in the CPU's caches
CHUNK_VALUES = 1 << 20


def _nibbles(qs: Tensor) -> Tensor:
    """[n, 16] uint8 -> [n, 2, 16] uint8: low nibbles are values 0-15, high ones 16-31."""
    return shifted(qs, (0, 4), 0x0F)


def _five_bits(qh: Tensor, qs: Tensor) -> Tensor:
    """qh [n, 4] uint8 (one little-endian uint32: bit j is value j's 5th bit), qs [n, 16]
    -> [n, 32] uint8 in 0..31."""
    high = shifted(qh, tuple(b - 4 for b in range(8)), 0x10)  # [n, 8 bits, 4 bytes]
    return _nibbles(qs).view(-1, 32) | high.transpose(1, 2).reshape(-1, 32)


def dequant_q8_0(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q8_0, 34 bytes per 32 values: [d: f16][q: 32 x int8]; x = d * q.
    blocks [n, 34] uint8 -> out [n, 32] float32, equal to gguf.quants.dequantize."""
    d = f16(blocks[:, 0:2])
    return scale_into(output(out, len(blocks), BLOCK), d[:, None], blocks[:, 2:].view(torch.int8))


def dequant_q4_0(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q4_0, 18 bytes per 32 values: [d: f16][q: 16 bytes of nibbles]; x = d * (q - 8).
    blocks [n, 18] uint8 -> out [n, 32] float32, equal to gguf.quants.dequantize."""
    d = f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:]).view(torch.int8) - 8
    return scale_into(output(out, len(blocks), BLOCK), d[:, None], q)


def dequant_q4_1(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q4_1, 20 bytes per 32 values: [d: f16][m: f16][q: 16 bytes of nibbles]; x = d * q + m.
    blocks [n, 20] uint8 -> out [n, 32] float32, equal to gguf.quants.dequantize."""
    d, m = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
    return scale_into(output(out, len(blocks), BLOCK), d[:, None], _nibbles(blocks[:, 4:]),
                      plus=m[:, None])


def dequant_q5_0(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q5_0, 22 bytes per 32 values: [d: f16][qh: 4 bytes, bit j = value j's 5th bit]
    [ql: 16 bytes of nibbles]; x = d * (q - 16).
    blocks [n, 22] uint8 -> out [n, 32] float32, equal to gguf.quants.dequantize."""
    d = f16(blocks[:, 0:2])
    q = _five_bits(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8) - 16
    return scale_into(output(out, len(blocks), BLOCK), d[:, None], q)


def dequant_q5_1(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q5_1, 24 bytes per 32 values: [d: f16][m: f16][qh: 4 bytes][ql: 16 bytes];
    x = d * q + m. blocks [n, 24] uint8 -> out [n, 32] float32, equal to
    gguf.quants.dequantize."""
    d, m = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
    q = _five_bits(blocks[:, 4:8], blocks[:, 8:])
    return scale_into(output(out, len(blocks), BLOCK), d[:, None], q, plus=m[:, None])


def dequant_iq4_nl(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """IQ4_NL, 18 bytes per 32 values: [d: f16][q: 16 bytes of nibbles]; x = d * LEVELS[q]
    (IQ4_LEVELS). blocks [n, 18] uint8 -> out [n, 32] float32, equal to
    gguf.quants.dequantize."""
    d = f16(blocks[:, 0:2])
    levels = lookup_nibbles(level_pairs(IQ4_LEVELS), blocks[:, 2:])
    return scale_into(output(out, len(blocks), BLOCK), d[:, None], levels)


KERNELS: dict[QType, Callable[[Tensor, Tensor | None], Tensor]] = {
    QType.Q8_0: dequant_q8_0, QType.Q4_0: dequant_q4_0, QType.Q4_1: dequant_q4_1,
    QType.Q5_0: dequant_q5_0, QType.Q5_1: dequant_q5_1, QType.IQ4_NL: dequant_iq4_nl,
    QType.Q2_K: kquants.dequant_q2_k, QType.Q3_K: kquants.dequant_q3_k,
    QType.Q4_K: kquants.dequant_q4_k, QType.Q5_K: kquants.dequant_q5_k,
    QType.Q6_K: kquants.dequant_q6_k, QType.IQ4_XS: kquants.dequant_iq4_xs,
}


# bits of each quant, scales aside: what `--quantization auto` matches (4 and below: int4)
QUANT_BITS = {QType.Q2_K: 2, QType.Q3_K: 3, QType.Q4_0: 4, QType.Q4_1: 4, QType.Q4_K: 4,
              QType.IQ4_NL: 4, QType.IQ4_XS: 4, QType.Q5_0: 5, QType.Q5_1: 5, QType.Q5_K: 5,
              QType.Q6_K: 6, QType.Q8_0: 8, QType.Q8_1: 8, QType.Q8_K: 8}


# types whose every block of 32 is one uniform 16-level grid, as int4 packs them (Q4_K's
# sub-blocks are 32 values, each with its own scale and minimum): packed without loss
INT4_EXACT = frozenset({QType.Q4_0, QType.Q4_1, QType.Q4_K})


def packing(qtype: QType) -> str | None:
    """How `--quantization auto` packs a weight of this type to keep its values: int4 for
    INT4_EXACT, int8 for any other quantized type (3-bit K-quants' 16-value sub-blocks and
    the IQ types' non-uniform codebooks do not fit int4's grid; int8 rounds them by under
    1/254 of a row's largest value), None for float types."""
    if quant_bits(qtype) is None:
        return None
    return "int4" if qtype in INT4_EXACT else "int8"


def quant_bits(qtype: QType) -> int | None:
    """Bits per quantized weight of a ggml type, None for float types; types without an
    entry in QUANT_BITS (IQ1-IQ3, TQ) count their bytes: an IQ2_XXS block of 256 in 66
    bytes is 2."""
    if qtype in QUANT_BITS:
        return QUANT_BITS[qtype]
    if qtype in PLAIN or qtype.name.startswith(("F", "I8", "I16", "I32", "I64")):
        return None
    values_per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    return 8 * block_bytes // values_per_block


def can_dequantize(qtype: QType) -> bool:
    """Whether ember reads this ggml type: a float type, a torch kernel here, or the `gguf`
    package's numpy code (tried on one block of zeros)."""
    if qtype in PLAIN or qtype in KERNELS:
        return True
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    try:
        gguf_quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def as_tensor(data: np.ndarray) -> Tensor:
    """A torch view of a (possibly read-only, memory-mapped) numpy array; never written to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(data))


def dequantize_blocks(raw: Tensor, qtype: QType, dtype: torch.dtype = torch.float32
                      ) -> Tensor:
    """raw uint8 bytes of whole blocks of a type in KERNELS -> [num_values] in `dtype`, a
    chunk of blocks at a time (the unpacked intermediates of a whole tensor would not fit in
    cache). Another dtype than float32 is rounded from each chunk's float32 values while they
    are in cache, so the whole tensor is never written, nor read back, in float32."""
    values_per_block, bytes_per_block = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, bytes_per_block)
    out = empty_huge((blocks.shape[0], values_per_block), dtype)
    step = max(1, CHUNK_VALUES // values_per_block)
    scratch = None if dtype == torch.float32 else \
        torch.empty(min(step, blocks.shape[0]), values_per_block, dtype=torch.float32)
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start:start + step]
        if scratch is None:
            KERNELS[qtype](chunk, out[start:start + step])
        else:
            KERNELS[qtype](chunk, scratch[:len(chunk)])
            out[start:start + step].copy_(scratch[:len(chunk)])
    return out.view(-1)


def dequantize(data: np.ndarray, qtype: QType, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> Tensor:
    """GGUF tensor bytes -> float tensor of `shape` (rows first, as torch orders them).

    `data` is what gguf.GGUFReader gives: the raw block bytes for quantized types, or the values
    for plain ones. Plain types keep their dtype; the others come back as `dtype` (float32's
    values rounded: a model loading in bfloat16 asks for it here).
    """
    if qtype in PLAIN:
        tensor = as_tensor(data)
        if qtype is QType.BF16 and tensor.dtype != torch.bfloat16:
            tensor = tensor.view(torch.uint8).view(torch.bfloat16)
        return tensor.reshape(shape)
    if qtype in KERNELS:
        return dequantize_blocks(as_tensor(data).view(torch.uint8), qtype,
                                 dtype).reshape(shape)
    values = gguf_quants.dequantize(np.ascontiguousarray(data), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
