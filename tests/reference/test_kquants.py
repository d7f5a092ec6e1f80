"""ember's torch dequantizers of GGUF block formats against the `gguf` package's numpy ones.

Reference: gguf.quants.dequantize. Every kernel does the reference's float32 operations in
the reference's order, so the results are compared bit for bit (torch.equal), with no
tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

from ember.quant.bits import HUGE_PAGE_BYTES, empty_huge
from ember.quant.formats import CHUNK_VALUES, KERNELS, dequantize

# byte offsets of each type's f16 fields within a block (from gguf's numpy code)
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
              Q.IQ4_NL: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
# the types gguf's numpy code can also quantize
QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 2] uint8: random half floats of any sign and exponent (zeros and subnormals
    included), never infinity or NaN."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    exponent_max = (bits & 0x7C00) == 0x7C00
    bits[exponent_max] &= 0xBFFF  # exponent 31 -> 15: a normal number near 1
    return bits.view(np.uint8).reshape(n, 2)


def random_blocks(qtype: Q, n: int, seed: int = 0) -> np.ndarray:
    """[n, bytes per block] uint8: random bytes, the f16 fields finite."""
    rng = np.random.default_rng(seed)
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset:offset + 2] = finite_f16(rng, n)
    return raw


def test_every_kernel_has_a_test():
    assert set(KERNELS) == set(F16_FIELDS)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_dequant_equals_gguf_bit_for_bit(qtype):
    # 1.3 M values in 64 rows: more than one chunk, the last one partial
    values_per_block, _ = GGML_QUANT_SIZES[qtype]
    rows = 64
    raw = random_blocks(qtype, CHUNK_VALUES // values_per_block * 5 // 4 + rows)
    want = torch.from_numpy(quants.dequantize(raw, qtype))
    got = dequantize(raw.reshape(rows, -1), qtype, (rows, want.numel() // rows))
    assert got.dtype == torch.float32
    assert torch.isfinite(want).all()
    assert torch.equal(got, want.reshape(got.shape))


def test_bfloat16_output_rounds_the_float32_values():
    # more than one chunk, into an output of more than one huge page
    raw = random_blocks(Q.Q2_K, CHUNK_VALUES // 256 * 3 // 2)
    shape = (len(raw), 256)
    want = dequantize(raw, Q.Q2_K, shape).to(torch.bfloat16)
    got = dequantize(raw, Q.Q2_K, shape, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("num_bytes", [4096, 3 * HUGE_PAGE_BYTES + 8])
def test_empty_huge_is_a_plain_writable_tensor(num_bytes):
    shape = (num_bytes // 8, 2)
    tensor = empty_huge(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view(shape))
    assert tensor[-1, -1].item() == tensor.numel() - 1  # the whole mapping is addressable
    assert torch.equal(tensor.sum(0), torch.arange(tensor.numel(), dtype=torch.float32
                                                   ).view(shape).sum(0))


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_kernel_writes_into_the_given_rows(qtype):
    """The loader hands each kernel a slice of one output tensor."""
    raw = random_blocks(qtype, 64, seed=1)
    values_per_block, _ = GGML_QUANT_SIZES[qtype]
    out = torch.full((len(raw) + 2, values_per_block), 7.0)
    returned = KERNELS[qtype](torch.from_numpy(raw), out[1:-1])
    want = torch.from_numpy(quants.dequantize(raw, qtype)).reshape(len(raw), -1)
    assert returned.data_ptr() == out[1].data_ptr()
    assert torch.equal(out[1:-1], want)
    assert (out[0] == 7).all() and (out[-1] == 7).all()


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_round_trip_through_gguf_quantize(qtype):
    """gguf quantizes random floats; ember's dequantization equals gguf's, and each value
    lies within one quantization step (the block's scale d) of the original."""
    rng = np.random.default_rng(2)
    weights = (rng.standard_normal((96, 512)) * rng.uniform(1e-3, 4, (96, 1))).astype(np.float32)
    packed = quants.quantize(weights, qtype)
    got = dequantize(packed, qtype, weights.shape)
    assert torch.equal(got, torch.from_numpy(quants.dequantize(packed, qtype)))
    blocks = packed.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    step = np.abs(blocks[:, 0:2].copy().view(np.float16).astype(np.float32))  # d, [n, 1]
    error = np.abs(got.numpy().reshape(-1, 32) - weights.reshape(-1, 32))
    assert (error <= step * 1.001).all()


def test_types_without_a_kernel_use_gguf_numpy():
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((4, 256)).astype(np.float32)
    packed = quants.quantize(weights, Q.TQ2_0)
    got = dequantize(packed, Q.TQ2_0, (4, 256))
    assert torch.equal(got, torch.from_numpy(quants.dequantize(packed, Q.TQ2_0)))
