"""GGUF super-block formats (K-quants and IQ4_XS), dequantized in plain torch.

Each format packs 256 values (QK_K) per super-block: one or two f16 scales for the super-block
and a small integer scale (and for some a minimum) per sub-block of 16 or 32 values. Every
kernel takes [n, bytes per block] uint8 and writes [n, 256] float32 (into `out` if given),
and must equal `gguf.quants.dequantize` (the reference, tests/reference/test_kquants.py) bit
for bit: each kernel does the reference's float32 operations in the reference's order, e.g.
(d * scale) * q - dmin * min, never d * (scale * q).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ember.quant.bits import f16, level_pairs, lookup_nibbles, output, scale_into, shifted

QK_K = 256
# ggml's kvalues_iq4nl: the 16 levels of IQ4_NL and IQ4_XS
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def q4k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The 12 scale bytes of Q4_K / Q5_K -> (scales, mins), each [n, 8] uint8 of 6 bits.

        byte  0-3  EEAAAAAA   A-D: scales 0-3, E-H: the high 2 bits of scales 4-7
        byte  4-7  eeaaaaaa   a-d: mins 0-3,   e-h: the high 2 bits of mins 4-7
        byte 8-11  eeeeEEEE   the low 4 bits of mins 4-7 (high) and scales 4-7 (low)
    """
    sc, mn, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([sc & 0x3F, (low & 0x0F) | ((sc >> 2) & 0x30)], dim=1)
    mins = torch.cat([mn & 0x3F, (low >> 4) | ((mn >> 2) & 0x30)], dim=1)
    return scales, mins


def _bit_pairs(qs: Tensor) -> Tensor:
    """[n, 64] uint8 -> [n, 256] uint8 of 2 bits: bit pair p of byte 32h + j is value
    128h + 32p + j (Q2_K's and Q3_K's quants, Q6_K's high bits)."""
    return shifted(qs.view(-1, 2, 32), (0, 2, 4, 6), 3).view(-1, QK_K)


def dequant_q2_k(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q2_K, 84 bytes per 256 values:
        [scales: 16 bytes, low nibble the scale and high nibble the min of sub-block i (16)]
        [qs: 64 bytes of bit pairs (_bit_pairs)][d: f16][dmin: f16]
    x = (d * scale) * q - dmin * min.
    blocks [n, 84] uint8 -> out [n, 256] float32, equal to gguf.quants.dequantize."""
    scales = blocks[:, 0:16]
    d, dmin = f16(blocks[:, 80:82]), f16(blocks[:, 82:84])
    dl = d[:, None] * (scales & 0x0F).float()
    ml = dmin[:, None] * (scales >> 4).float()
    return scale_into(output(out, len(blocks), QK_K), dl, _bit_pairs(blocks[:, 16:80]), ml)


def dequant_q3_k(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q3_K, 110 bytes per 256 values:
        [hmask: 32 bytes; bit b of byte j is set when value 32b + j has no -4 offset]
        [qs: 64 bytes of bit pairs (_bit_pairs)][scales: 12 bytes][d: f16]
    The 16 scales have 6 bits: the low 4 are nibbles of bytes 0-7 (scales 0-7 low nibbles,
    8-15 high), the high 2 are bit pairs of bytes 8-11 (pair p of byte j: scale 4p + j).
    x = (d * (scale - 32)) * (q - 4 + 4 * hbit).
    blocks [n, 110] uint8 -> out [n, 256] float32, equal to gguf.quants.dequantize."""
    raw = blocks[:, 96:108]
    low = shifted(raw[:, 0:8], (0, 4), 0x0F).flatten(1)
    high = shifted(raw[:, 8:12], (-4, -2, 0, 2), 0x30).flatten(1)
    scales = ((low | high).view(torch.int8) - 32).float()
    dl = f16(blocks[:, 108:110])[:, None] * scales
    hbits = shifted(blocks[:, 0:32], tuple(b - 2 for b in range(8)), 4).view(-1, QK_K)
    q = (_bit_pairs(blocks[:, 32:96]) | hbits).view(torch.int8) - 4
    return scale_into(output(out, len(blocks), QK_K), dl, q)


def _nibble_runs(qs: Tensor) -> Tensor:
    """[n, 128] uint8 -> [n, 256] uint8: byte 32c + j holds value 64c + j in its low nibble and
    64c + 32 + j in its high one (Q4_K's and Q5_K's quants)."""
    return shifted(qs.view(-1, 4, 32), (0, 4), 0x0F).view(-1, QK_K)


def _dequant_min_scaled(blocks: Tensor, q: Tensor, out: Tensor | None) -> Tensor:
    """Q4_K / Q5_K: [d: f16][dmin: f16][scales: 12 bytes] then the quants q [n, 256];
    x = (d * scale) * q - dmin * min, per sub-block of 32."""
    d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
    scales, mins = q4k_scales(blocks[:, 4:16])
    dl = d[:, None] * scales.float()
    ml = dmin[:, None] * mins.float()
    return scale_into(output(out, len(blocks), QK_K), dl, q, ml)


def dequant_q4_k(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q4_K, 144 bytes per 256 values:
        [d: f16][dmin: f16][scales: 12 bytes, 8 scales and 8 mins of 6 bits (q4k_scales)]
        [qs: 128 bytes of nibbles (_nibble_runs)]
    x = (d * scale) * q - dmin * min, per sub-block of 32.
    blocks [n, 144] uint8 -> out [n, 256] float32, equal to gguf.quants.dequantize."""
    return _dequant_min_scaled(blocks, _nibble_runs(blocks[:, 16:144]), out)


def dequant_q5_k(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q5_K, 176 bytes per 256 values:
        [d: f16][dmin: f16][scales: 12 bytes, as Q4_K][qh: 32 bytes; bit b of byte j is the
        5th bit of value 32b + j][qs: 128 bytes, the low 4 bits as in Q4_K]
    x = (d * scale) * q - dmin * min, per sub-block of 32.
    blocks [n, 176] uint8 -> out [n, 256] float32, equal to gguf.quants.dequantize."""
    high = shifted(blocks[:, 16:48], tuple(b - 4 for b in range(8)), 0x10).view(-1, QK_K)
    return _dequant_min_scaled(blocks, _nibble_runs(blocks[:, 48:176]) | high, out)


def dequant_q6_k(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """Q6_K, 210 bytes per 256 values:
        [ql: 128 bytes; byte 64h + j holds the low 4 bits of value 128h + j (low nibble) and
        of 128h + 64 + j (high)][qh: 64 bytes of bit pairs (_bit_pairs), the high 2 bits]
        [scales: 16 x int8, one per sub-block of 16][d: f16]
    x = (d * scale) * (q - 32).
    blocks [n, 210] uint8 -> out [n, 256] float32, equal to gguf.quants.dequantize."""
    low = shifted(blocks[:, 0:128].view(-1, 2, 64), (0, 4), 0x0F).view(-1, QK_K)
    high = shifted(blocks[:, 128:192].view(-1, 2, 32), (-4, -2, 0, 2), 0x30).view(-1, QK_K)
    q = (low | high).view(torch.int8) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    dl = f16(blocks[:, 208:210])[:, None] * scales
    return scale_into(output(out, len(blocks), QK_K), dl, q)


def dequant_iq4_xs(blocks: Tensor, out: Tensor | None = None) -> Tensor:
    """IQ4_XS, 136 bytes per 256 values:
        [d: f16][scales_h: 2 bytes, bit pair i of the little-endian uint16 is the high 2 bits
        of scale i][scales_l: 4 bytes, nibbles: low nibble of byte j is scale 2j, high 2j + 1]
        [qs: 128 bytes; byte 16s + j holds value 32s + j (low nibble) and 32s + 16 + j (high)]
    x = (d * (scale - 32)) * IQ4_LEVELS[q], per sub-block of 32.
    blocks [n, 136] uint8 -> out [n, 256] float32, equal to gguf.quants.dequantize."""
    d = f16(blocks[:, 0:2])
    high_bits = blocks[:, 2].int() | (blocks[:, 3].int() << 8)                    # [n]
    high = (high_bits[:, None] >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [n, 8]
    low = shifted(blocks[:, 4:8], (0, 4), 0x0F).transpose(1, 2).flatten(1)        # [n, 8]
    dl = d[:, None] * ((low.int() | (high << 4)) - 32).float()
    levels = lookup_nibbles(level_pairs(IQ4_LEVELS), blocks[:, 8:136].view(-1, 8, 16))
    return scale_into(output(out, len(blocks), QK_K), dl, levels)
