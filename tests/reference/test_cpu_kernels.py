"""The compiled CPU kernels (ember/kernels) against the torch code they replace.

Reference: ember's torch path (F.rms_norm, apply_rope + PagedKV.write, F.silu, the gathered
matmul attention), itself checked against transformers elsewhere; then whole engines with and
without the kernels.
"""
from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ember import LLM
from ember.kernels import (CpuKernels, build_cpu_ops, load_kernels, pack_int4_panels,
                           pack_int8_panels, pack_int8_quads, unpack_int4_panels)
from ember.models.attention import PagedKV, _matmul_attention
from ember.models.layers import apply_rope, rope_cos_sin, rope_inv_freq
from ember.models.parallel import zero_skipped
from ember.request import Request, RequestOptions, SamplingParams
from ember.sampling.sampler import Sampler
from tests.conftest import assert_greedy_close

# float32: the same maths in another order (fused multiply-adds); bfloat16: rounding steps
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return CpuKernels(build_cpu_ops())  # a failed build is a failure here, not a skip


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_add(kernels, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=g).to(dtype)
    residual = torch.randn(5, 576, generator=g).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    close(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5), dtype)
    summed = residual + x
    stream = residual.clone()
    out = kernels.rms_norm(x, weight, 1e-5, stream)
    assert torch.equal(stream, summed)          # the add is written in place, rounded alike
    close(out, F.rms_norm(summed, (576,), weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 32])
def test_rope_write_rotates_q_and_k_and_fills_the_cache(kernels, dtype, head_dim):
    heads, kv_heads, tokens, blocks, block_size = 6, 2, 7, 5, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 9, 17, 4, 5, 30])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 10000.0, None), dtype)
    slots = torch.tensor([3, 0, 19, 7, 8, 12, 1])
    got_cache = PagedKV(torch.zeros(2, kv_heads, blocks, block_size, head_dim, dtype=dtype))
    q = kernels.rope_write(qkv, cos, sin, got_cache.data, slots, heads, kv_heads)

    want_cache = PagedKV(torch.zeros_like(got_cache.data))
    x = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    qk = apply_rope(x[:, :heads + kv_heads].float(), cos.float(), sin.float())
    want_cache.write(qk[:, heads:].to(dtype), x[:, heads + kv_heads:], slots)
    close(q, qk[:, :heads], dtype)
    close(got_cache.data, want_cache.data, dtype)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rope_write(qkv, cos, sin, got_cache.data, slots + 100, heads, kv_heads)


def int8_cache(kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
               g: torch.Generator) -> PagedKV:
    """A PagedKV int8 cache filled through its own write (random values, scattered scales)."""
    cache = PagedKV(torch.zeros(2, kv_heads, num_blocks, block_size, head_dim, dtype=torch.int8),
                    torch.zeros(2, kv_heads, num_blocks, block_size, dtype=torch.float16))
    slots = num_blocks * block_size
    spread = torch.rand(slots, kv_heads, 1, generator=g) * 4
    k, v = (torch.randn(slots, kv_heads, head_dim, generator=g) * spread for _ in range(2))
    cache.write(k.to(torch.bfloat16), v.to(torch.bfloat16), torch.arange(slots))
    return cache


def bf16_or_int8_cache(int8: bool, num_blocks: int, block_size: int,
                       g: torch.Generator) -> PagedKV:
    """3 KV heads of 64: an int8 cache (int8_cache) or random bfloat16 values."""
    if int8:
        return int8_cache(3, num_blocks, block_size, 64, g)
    return PagedKV(torch.randn(2, 3, num_blocks, block_size, 64, generator=g).to(torch.bfloat16))


def test_rope_write_into_an_int8_cache_quantizes_as_paged_kv_does(kernels):
    """k rotated (and rounded to bfloat16, as the torch path holds it) and v, each head
    rounded to int8 with its own float16 scale: PagedKV.write's rule. The rotation's last
    float32 bit may differ (fused multiply-adds), so a value may land one step over."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: an int8 cache takes the torch path")
    heads, kv_heads, tokens, blocks, block_size, head_dim = 6, 2, 7, 5, 4, 64
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3
           ).to(torch.bfloat16)
    positions = torch.tensor([0, 3, 9, 17, 4, 5, 30])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 10000.0, None), torch.bfloat16)
    slots = torch.tensor([3, 0, 19, 7, 8, 12, 1])
    shape = (2, kv_heads, blocks, block_size, head_dim)
    got = PagedKV(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:-1],
                                                                     dtype=torch.float16))
    q = kernels.rope_write(qkv, cos, sin, got.data, slots, heads, kv_heads, got.scale)
    want = PagedKV(torch.zeros_like(got.data), torch.zeros_like(got.scale))
    x = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    qk = apply_rope(x[:, :heads + kv_heads].float(), cos.float(), sin.float())
    want.write(qk[:, heads:].to(torch.bfloat16), x[:, heads + kv_heads:], slots)
    close(q, qk[:, :heads], torch.bfloat16)
    torch.testing.assert_close(got.scale, want.scale, rtol=2e-3, atol=0)
    steps = (got.data.int() - want.data.int()).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.99
    assert torch.equal(got.data[:, :, 1], want.data[:, :, 1])      # slots 4-7: only slot 7
    with pytest.raises(RuntimeError, match="kv_scale"):
        kernels.rope_write(qkv, cos, sin, got.data, slots, heads, kv_heads, got.scale.float())
    # k_out: the rotated k before its rounding to int8, which rounds to the cache's int8 k
    k_out = torch.empty(tokens, kv_heads, head_dim, dtype=torch.bfloat16)
    again = PagedKV(torch.zeros_like(got.data), torch.zeros_like(got.scale))
    q2 = kernels.rope_write(qkv, cos, sin, again.data, slots, heads, kv_heads, again.scale,
                            k_out)
    assert torch.equal(q2, q) and torch.equal(again.data, got.data)
    close(k_out, qk[:, heads:], torch.bfloat16)
    rounded = PagedKV(torch.zeros_like(got.data), torch.zeros_like(got.scale))
    rounded.write(k_out, x[:, heads + kv_heads:], slots)
    assert torch.equal(rounded.data, got.data) and torch.equal(rounded.scale, got.scale)
    with pytest.raises(RuntimeError, match="k_out"):
        kernels.rope_write(qkv, cos, sin, got.data, slots, heads, kv_heads, got.scale,
                           k_out[:3])


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 9, 3),
                                                              (64, 20, 1)])  # 20 per KV head
@pytest.mark.parametrize("lengths", [[1, 16, 17, 150, 37], [700]])
def test_decode_attention_reads_an_int8_cache_in_place(kernels, head_dim, heads, kv_heads,
                                                       lengths):
    """The int8 path (q rounded to int16, int16 dot products, the scales applied after)
    against dequantizing the gathered context and attending in float32."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: an int8 cache takes the torch path")
    g = torch.Generator().manual_seed(12)
    cache = int8_cache(kv_heads, 60, 16, head_dim, g)
    q, tables, seq_lens, scale, want = decode_case(cache, heads, lengths, torch.bfloat16, g)
    got = kernels.decode_attention(q, cache.data, tables, seq_lens, scale, cache.scale)
    close(got, want, torch.bfloat16)
    strided = torch.cat([q, q], dim=1)[:, :heads]
    assert torch.equal(kernels.decode_attention(strided, cache.data, tables, seq_lens, scale,
                                                cache.scale), got)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.decode_attention(q.float(), cache.data, tables, seq_lens, scale, cache.scale)


@pytest.mark.parametrize("int8", [False, True])
def test_decode_attention_of_a_request_does_not_depend_on_its_batch(kernels, int8):
    """Each request's output is the same, bit for bit, attended alone or beside others of
    other lengths: the decode stack attends a step's requests in one call, the layer-by-layer
    path group by group, and their outputs must stay equal (a split of the work chosen by
    the batch, such as cutting contexts into parts where requests are few, would break it)."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: these kernels take the torch path")
    g = torch.Generator().manual_seed(15)
    cache = bf16_or_int8_cache(int8, 64, 16, g)
    q, tables, seq_lens, scale, want = decode_case(cache, 9, [900, 3, 520, 64, 255],
                                                   torch.bfloat16, g)
    together = kernels.decode_attention(q, cache.data, tables, seq_lens, scale, cache.scale)
    close(together, want, torch.bfloat16)
    for i in range(len(seq_lens)):
        alone = kernels.decode_attention(q[i:i + 1], cache.data, tables[i:i + 1],
                                         seq_lens[i:i + 1], scale, cache.scale)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("cache_kind", ["bfloat16", "int8", "float32"])
def test_decode_attention_leaves_skipped_kv_heads_to_another_rank(kernels, cache_kind):
    """A request whose skip bit h is set gets zeros for KV head h's query heads and, for
    every other head, what it gets without skip, bit for bit (the float32 cache: the
    scalar kernel); zero_skipped (the torch paths') masks the same heads."""
    if cache_kind != "float32" and not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: these kernels take the torch path")
    g = torch.Generator().manual_seed(16)
    dtype = torch.float32 if cache_kind == "float32" else torch.bfloat16
    cache = bf16_or_int8_cache(cache_kind == "int8", 64, 16, g) if cache_kind != "float32" \
        else PagedKV(torch.randn(2, 3, 64, 16, 64, generator=g))
    q, tables, seq_lens, scale, _ = decode_case(cache, 9, [40, 3, 200, 17], dtype, g)
    skip = torch.tensor([0b010, 0, 0b101, 0b111])
    whole = kernels.decode_attention(q, cache.data, tables, seq_lens, scale, cache.scale)
    got = kernels.decode_attention(q, cache.data, tables, seq_lens, scale, cache.scale, skip)
    want = zero_skipped(whole.clone(), skip, 3)
    assert torch.equal(got, want)
    assert torch.equal(got[1], whole[1]) and not got[3].any()
    assert not got[0, 3:6].any() and torch.equal(got[0, :3], whole[0, :3])


@pytest.mark.parametrize("int8", [False, True])
def test_attention_kernels_walk_blocks_of_any_size(kernels, int8):
    """Block sizes that are not a power of two take the division path of the slot lookup
    (powers of two take shift and mask): decode and prefill attention over 12-token blocks."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: these kernels take the torch path")
    g = torch.Generator().manual_seed(14)
    cache = bf16_or_int8_cache(int8, 50, 12, g)
    q, tables, seq_lens, scale, want = decode_case(cache, 9, [5, 37, 130], torch.bfloat16, g)
    close(kernels.decode_attention(q, cache.data, tables, seq_lens, scale, cache.scale), want,
          torch.bfloat16)
    q, table, scale, want = prefill_case(cache, 9, 20, 101, g, context_dtype=torch.bfloat16)
    close(kernels.prefill_attention(q, cache.data, table, 101, scale, cache.scale), want,
          torch.bfloat16)


@pytest.mark.parametrize(("head_dim", "new", "seq_len"), [(64, 7, 7), (64, 50, 181),
                                                          (128, 33, 97)])
def test_prefill_attention_reads_an_int8_cache(kernels, head_dim, new, seq_len):
    """Prompt chunks over an int8 cache: its rows made bfloat16 (value * scale, rounded once)
    as they are packed, against the gathered context dequantized and rounded alike, attended
    in float32."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: an int8 cache takes the torch path")
    g = torch.Generator().manual_seed(13)
    cache = int8_cache(3, 40, 16, head_dim, g)
    q, table, scale, want = prefill_case(cache, 9, new, seq_len, g,
                                         context_dtype=torch.bfloat16)
    close(kernels.prefill_attention(q, cache.data, table, seq_len, scale, cache.scale), want,
          torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernels, dtype):
    x = torch.randn(3, 2 * 100, generator=torch.Generator().manual_seed(2)).to(dtype) * 4
    gate, up = x.float().chunk(2, dim=-1)
    close(kernels.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 250, 49152])
def test_argmax_rows_is_torch_argmax_ties_infinities_and_nans_included(kernels, width):
    g = torch.Generator().manual_seed(width)
    cases = [torch.randn(3, width, generator=g),
             torch.randint(-2, 2, (3, width), generator=g).float(),   # ties: the first wins
             torch.full((2, width), float("-inf"))]
    spiked = torch.randn(4, width, generator=g)
    spiked[torch.rand(4, width, generator=g) < 0.05] = float("inf")
    spiked[1, -1] = float("nan")                   # a NaN counts as the largest
    spiked[2, width // 2] = float("nan")
    cases.append(spiked)
    wide = torch.randn(2, width + 7, generator=g)[:, :width]   # rows with a stride
    cases.append(wide)
    for x in cases:
        assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_thread_sync_ns_bounces_a_line_only_between_two_threads(kernels):
    """The round trip needs a second thread (NaN with one); the parallel region is timed
    either way; no rounds is refused."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        trip, region = kernels.thread_sync_ns(1)
        assert math.isnan(trip) and math.isfinite(region) and region > 0
        if (os.cpu_count() or 1) >= 2:   # two threads on one core would bounce by time slices
            torch.set_num_threads(2)
            trip, region = kernels.thread_sync_ns(1)
            assert math.isfinite(trip) and trip > 0 and math.isfinite(region) and region > 0
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="rounds must be >= 1"):
        kernels.thread_sync_ns(0)


def test_a_sampler_on_the_kernels_argmax_draws_what_one_on_torch_draws(kernels):
    """Greedy rows and seeded random ones, side by side: the same tokens and logprobs."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=0, presence_penalty=1.0, logprobs=2),
              SamplingParams(temperature=1.2, top_k=40, seed=9),
              SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=11),
              SamplingParams(temperature=0, logit_bias={17: 50.0})]
    draws = []
    for with_kernels in (kernels, None):
        requests = [Request(f"r{i}", [1, 17, 4], p, frozenset({2}), 100)
                    for i, p in enumerate(params)]
        sampler = Sampler(0, torch.device("cpu"), with_kernels)
        draws.append([sampler.sample(logits.clone(), requests) for _ in range(3)])
    assert draws[0] == draws[1]
    assert draws[0][0][0][5] == 17


def decode_case(cache: PagedKV, heads: int, lengths: list[int], dtype: torch.dtype,
                g: torch.Generator):
    """One new token per request over scattered blocks of `cache`: (q, block tables, seq_lens,
    scale, the reference output: the context gathered (dequantized) and attended with the
    torch matmul path in float32)."""
    _, _, num_blocks, block_size, head_dim = cache.data.shape
    seq_lens = torch.tensor(lengths)
    width = -(-int(seq_lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in seq_lens])
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    keys = torch.arange(width * block_size)
    bias = torch.zeros(len(seq_lens), 1, 1, width * block_size)
    bias.masked_fill_(keys[None, None, None, :] >= seq_lens[:, None, None, None],
                      float("-inf"))
    k, v = cache.gather(tables, torch.float32)
    return q, tables, seq_lens, scale, _matmul_attention(q.float()[:, None], k, v, bias,
                                                         scale)[:, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 48])   # unrolled sizes, and any other
@pytest.mark.parametrize("lengths", [[1, 16, 17, 150, 37], [700], [5, 333]])
def test_decode_attention_reads_the_paged_cache_in_place(kernels, dtype, head_dim, lengths):
    """Requests of different lengths over scattered blocks, grouped query heads (3 per KV
    head), against gathering the context and attending with the torch matmul path."""
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 60
    g = torch.Generator().manual_seed(3)
    cache = PagedKV(torch.randn(2, kv_heads, num_blocks, block_size, head_dim,
                                generator=g).to(dtype))
    q, tables, seq_lens, scale, want = decode_case(cache, heads, lengths, dtype, g)
    width = tables.shape[1]
    close(kernels.decode_attention(q, cache.data, tables, seq_lens, scale), want, dtype)
    strided = torch.cat([q, q], dim=1)[:, :heads]          # q as the model hands it over
    close(kernels.decode_attention(strided, cache.data, tables, seq_lens, scale), want, dtype)
    with pytest.raises(RuntimeError, match="seq_lens"):
        kernels.decode_attention(q, cache.data, tables, seq_lens + width * block_size, scale)


def prefill_case(cache: PagedKV, heads: int, new: int, seq_len: int, g: torch.Generator,
                 spare_blocks: int = 0, context_dtype: torch.dtype = torch.float32):
    """A request's last `new` of seq_len tokens over scattered blocks of `cache` (its block
    table `spare_blocks` longer than needed): (q, block table, scale, the reference: the
    context gathered (dequantized, then rounded to context_dtype), attended causally with the
    torch matmul path in float32)."""
    _, _, num_blocks, block_size, head_dim = cache.data.shape
    width = -(-seq_len // block_size)
    table = torch.randperm(num_blocks, generator=g)[:width + spare_blocks]
    q = torch.randn(new, heads, head_dim, generator=g).to(torch.bfloat16)
    scale = head_dim ** -0.5
    keys = torch.arange(width * block_size)
    queries = torch.arange(seq_len - new, seq_len)
    bias = torch.zeros(1, 1, new, width * block_size)
    bias.masked_fill_((keys[None, :] > queries[:, None])[None, None], float("-inf"))
    k, v = (x.to(context_dtype).float()
            for x in cache.gather(table[None, :width], torch.float32))
    return q, table, scale, _matmul_attention(q.float()[None], k, v, bias, scale)[0]


@pytest.mark.parametrize(("head_dim", "new", "seq_len"), [
    (64, 1, 1), (64, 7, 7), (64, 130, 130),       # fresh prompt chunks (one block, many)
    (64, 50, 181), (64, 200, 331),                 # continued chunks after earlier context
    (128, 33, 97), (128, 64, 64)])
def test_prefill_attention_is_causal_attention_over_the_paged_context(kernels, head_dim, new,
                                                                      seq_len):
    """A request's last `new` tokens over its scattered blocks (3 query heads per KV head),
    against gathering the context and attending with the torch matmul path in float32."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: prompt chunks take the torch path")
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 40
    g = torch.Generator().manual_seed(4)
    cache = PagedKV(torch.randn(2, kv_heads, num_blocks, block_size, head_dim,
                                generator=g).to(torch.bfloat16))
    width = -(-seq_len // block_size)
    q, table, scale, want = prefill_case(cache, heads, new, seq_len, g, spare_blocks=1)
    got = kernels.prefill_attention(q, cache.data, table, seq_len, scale)
    close(got, want, torch.bfloat16)
    strided = torch.cat([q, q], dim=1)[:, :heads]          # rows as the model hands them over
    assert torch.equal(kernels.prefill_attention(strided, cache.data, table, seq_len, scale),
                       got)
    with pytest.raises(RuntimeError, match="seq_len"):
        kernels.prefill_attention(q, cache.data, table, (width + 2) * block_size, scale)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prefill_attention(q.float(), cache.data, table, seq_len, scale)


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 17, 40])   # tiles, and rows left over
def test_int8_linear_is_the_dequantized_matmul(kernels, m):
    """x w^T with w = q * scale per row, in float32: the int8 values are exact in bfloat16,
    so only the order of the float32 sums differs. n = 80: panels in a group of 4 and one
    left over; rows strided as the model hands them over."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: the output projection stays PackedLinear")
    n, k = 80, 96
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) / 64
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, :k]
    want = x.float() @ (q.float() * scales[:, None]).T
    got = kernels.int8_linear(x, pack_int8_panels(q), scales)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.int8_linear(x[:, :64].contiguous(), pack_int8_panels(q), scales)


@pytest.mark.parametrize(("m", "k", "group"), [(1, 96, 0), (2, 576, 64), (4, 96, 32),
                                               (7, 576, 64), (8, 64, 16), (25, 576, 192),
                                               (40, 64, 16)])
def test_int8_linear_a8_is_the_matmul_of_x_rounded_per_group(kernels, m, k, group):
    """x rounded to int8 per row and group of inputs (max / 127, round half to even), an
    exact integer product, the two scales: the reference in float64 (the kernel sums the
    groups in float32). n = 80: a tile of 4 panels and one left over; tiles of 3 rows and
    the rest; strided rows. Within int8 rounding of the plain float matmul."""
    if not kernels.has_int8_dot:
        pytest.skip("this CPU has no AVX-512 VNNI: the output projection keeps bfloat16 inputs")
    n, size = 80, group or k
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) / 64
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, :k]
    v = x.float().view(m, k // size, size)
    amax = v.abs().amax(dim=2)
    xq = torch.round(v * (torch.full_like(amax, 127) / amax)[..., None])
    want = sum((xq[:, i].double() @ q[:, i * size:(i + 1) * size].double().T)
               * (amax[:, i] / 127).double()[:, None] for i in range(k // size))
    got = kernels.int8_linear_a8(x, pack_int8_panels(q), scales, group)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want * scales.double(), rtol=1e-5,
                               atol=1e-6 * float(want.abs().max()) * float(scales.max()))
    exact = x.float() @ (q.float() * scales[:, None]).T
    assert (got - exact).abs().max() < 0.03 * exact.abs().max()
    # the same weight kept in quads (the output projection's; up to 8 rows read as one
    # stream per thread, more in tiles, where the pairs always go): the same sums, bit for bit
    assert torch.equal(kernels.int8_linear_a8(x, pack_int8_quads(q), scales, group), got)
    with pytest.raises(RuntimeError, match="group"):
        kernels.int8_linear_a8(x, pack_int8_panels(q), scales, 6)
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.int8_linear_a8(x, pack_int8_quads(q[:, :k - 4]), scales, 0)


@pytest.mark.parametrize("n", [80, 720])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11])   # register tiles of each size, several
def test_int4_linear_is_the_dequantized_matmul(kernels, m, n):
    """x w^T with w = q * scale + min per group of 32 inputs (scales and minima as the kernel
    holds them, in float16), in float32 then rounded to bfloat16 once: the kernel's only
    rounding is that last one and the order of its float32 sums. n = 80: 5 panels; n = 720:
    45 panels, split between the threads (at two or more) in shares of unequal length."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: int4 runs on torch's packed kernel")
    k = 96
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 32
    minimum = -8 * scale + torch.randn(n, k // 32, generator=g) / 100
    w = (q.view(n, k // 32, 32) * scale.half().float()[..., None]
         + minimum.half().float()[..., None]).view(n, k)
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, :k]
    want = x.float() @ w.T
    got = kernels.int4_linear(x, *pack_int4_panels(q, scale, minimum))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-4 * want.abs().max())
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.int4_linear(x[:, :64].contiguous(), *pack_int4_panels(q, scale, minimum))


def test_int4_linear_rows_do_not_depend_on_their_neighbours(kernels):
    """Each row of an m-row product equals that row multiplied alone, bit for bit, for every
    m up to two register tiles and over: a step verifying speculative drafts (several rows of
    one request) then computes each as a one-row decode step would, which greedy identity
    with speculation off rests on. Reference: the kernel's own one-row product."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: int4 runs on torch's packed kernel")
    n, k = 3072, 1536   # a float32 sum taken in another order shows in a few of 3M outputs
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 32
    minimum = -8 * scale + torch.randn(n, k // 32, generator=g) / 100
    packed = pack_int4_panels(q, scale, minimum)
    x = torch.randn(11, k, generator=g).to(torch.bfloat16)
    alone = torch.cat([kernels.int4_linear(x[r:r + 1], *packed) for r in range(11)])
    for m in range(2, 12):
        assert torch.equal(kernels.int4_linear(x[:m], *packed), alone[:m]), m


def _w8a8_reference(x, q, scales, smooth):
    """Each row of x * smooth rounded to int8 by its own max, an exact integer matmul, then
    the two scales: the kernel's arithmetic in torch (float32, round half to even; 127 / max
    as a true division, which torch's `127 / tensor`, a reciprocal times 127, is not)."""
    v = x.float() * smooth
    amax = v.abs().amax(dim=1)
    xq = torch.round(v * (torch.full_like(amax, 127) / amax)[:, None]).clamp(-127, 127)
    xq = xq.to(torch.int32)
    return (xq @ q.to(torch.int32).T).float() * ((amax / 127)[:, None] * scales[None, :])


def _w8a8_operands(m: int, k: int, n: int, seed: int):
    """x [m, k] bfloat16 with strided rows, q [n, k] int8, scales [n] and smooth [k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, :k]
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return x, q, torch.rand(n, generator=g) / 64, torch.rand(k, generator=g) + 0.5


@pytest.mark.parametrize(("m", "k", "n"), [(1, 96, 80), (7, 100, 80), (33, 100, 34)])
def test_w8a8_linear_is_the_rounded_matmul(kernels, m, k, n):
    """Bit for bit the reference above (inputs with a 16-lane tail, strided rows, an odd
    number of outputs), and within int8 rounding of the float matmul it approximates."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: prompt matmuls stay bfloat16")
    x, q, scales, smooth = _w8a8_operands(m, k, n, seed=8)
    got = kernels.w8a8_linear(x, q, scales, smooth)
    assert torch.equal(got, _w8a8_reference(x, q, scales, smooth).to(torch.bfloat16))
    exact = (x.float() * smooth) @ (q.float() * scales[:, None]).T
    assert (got.float() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize(("m", "k", "n", "group"), [(7, 96, 80, 32), (40, 1536, 48, 512)])
def test_w8a8_linear_in_groups_scales_each_group_of_a_row_alone(kernels, m, k, n, group):
    """One scale per `group` inputs of a row: the per-group products summed (within float32
    rounding of that sum, which the kernel fuses); a group with one huge input leaves the
    row's other groups as precise as they were alone."""
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: prompt matmuls stay bfloat16")
    g = torch.Generator().manual_seed(10)
    x = torch.randn(m, 2 * k, generator=g)
    x[:, 3] = 500.0                                     # an outlier in the first group
    x = x.to(torch.bfloat16)[:, :k]
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales, smooth = torch.rand(n, generator=g) / 64, torch.rand(k, generator=g) + 0.5
    want = sum(_w8a8_reference(x[:, s:s + group], q[:, s:s + group], torch.ones(n),
                               smooth[s:s + group]) for s in range(0, k, group)) * scales
    got = kernels.w8a8_linear(x, q, scales, smooth, group=group)
    close(got, want, torch.bfloat16)
    rest = slice(group, k)                              # without the outlier's group
    exact = (x[:, rest].float() * smooth[rest]) @ (q[:, rest].float() * scales[:, None]).T
    first = _w8a8_reference(x[:, :group], q[:, :group], scales, smooth[:group])
    grouped_err = (got.float() - first - exact).abs().max()
    per_row_err = (kernels.w8a8_linear(x, q, scales, smooth).float() - first - exact).abs().max()
    assert grouped_err < per_row_err / 4
    assert torch.equal(kernels.w8a8_linear(x, q, scales, smooth, group=k),
                       kernels.w8a8_linear(x, q, scales, smooth))   # one group: per row
    with pytest.raises(RuntimeError, match="group"):
        kernels.w8a8_linear(x, q, scales, smooth, group=k // 2 + 1)


def test_w8a8_linear_with_swiglu_is_silu_gate_times_up(kernels):
    if not kernels.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: prompt matmuls stay bfloat16")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(19, 64, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (2 * 40, 64), generator=g, dtype=torch.int8)
    scales, smooth = torch.rand(80, generator=g) / 64, torch.ones(64)
    gate, up = _w8a8_reference(x, q, scales, smooth).chunk(2, dim=1)
    got = kernels.w8a8_linear(x, q, scales, smooth, swiglu=True)
    assert got.shape == (19, 40)
    close(got, F.silu(gate) * up, torch.bfloat16)
    with pytest.raises(RuntimeError, match="smooth"):
        kernels.w8a8_linear(x, q, scales, torch.ones(63))
    with pytest.raises(RuntimeError, match="int8"):
        kernels.w8a8_linear(x, q.float(), scales, smooth)


@pytest.mark.parametrize(("m", "k", "n", "group", "swiglu"), [
    (1, 64, 32, 0, False), (7, 96, 80, 32, False), (40, 1536, 48, 512, False),
    (11, 64, 96, 0, True), (64, 128, 160, 0, True), (300, 576, 96, 64, False)])
def test_w8a8_linear_on_quads_is_the_same_as_on_rows(kernels, m, k, n, group, swiglu):
    """The weight in quads (ember's int8 tiles) gives the plain int8 weight's result (oneDNN's
    GEMM) bit for bit: the same int32 sums and the same arithmetic after them, for tiles with
    leftover rows and panels, row parts, groups, SwiGLU and strided rows."""
    if not kernels.has_int8_dot:
        pytest.skip("this CPU has no AVX-512 VNNI: int8 weights stay in rows")
    x, q, scales, smooth = _w8a8_operands(m, k, n, seed=11)
    quads = pack_int8_quads(q)
    assert quads.shape == (n // 16, k // 4, 16, 4) and quads.dtype == torch.uint8
    assert int(quads[1, 2, 3, 1]) == int(q[16 + 3, 4 * 2 + 1]) + 128
    got = kernels.w8a8_linear(x, quads, scales, smooth, swiglu=swiglu, group=group)
    want = kernels.w8a8_linear(x, q, scales, smooth, swiglu=swiglu, group=group)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        kernels.w8a8_linear(x, quads, scales, smooth, group=2)
    with pytest.raises(RuntimeError, match="quads"):
        kernels.w8a8_linear(x, quads.to(torch.int8), scales, smooth)


def test_int4_panels_unpack_to_what_was_packed():
    g = torch.Generator().manual_seed(10)
    q = torch.randint(0, 16, (48, 96), generator=g)
    scale, minimum = torch.rand(48, 3, generator=g), torch.randn(48, 3, generator=g)
    back = unpack_int4_panels(*pack_int4_panels(q, scale, minimum))
    assert torch.equal(back[0].long(), q)
    assert torch.equal(back[1], scale.half().float())     # as the kernel holds them
    assert torch.equal(back[2], minimum.half().float())


@pytest.mark.parametrize("pack", [pack_int8_panels, pack_int8_quads])
def test_int8_rows_read_the_panels_back(kernels, pack):
    """Rows of an int8 weight from its pairs (int8_linear's) or its quads (int8_linear_a8's,
    each value + 128): a tied embedding reads the output projection's weight as kept."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-128, 128, (64, 32), generator=g, dtype=torch.int8)
    scales = torch.rand(64, generator=g)
    ids = torch.tensor([0, 17, 63, 17, 5])
    want = (q[ids].float() * scales[ids, None]).to(torch.bfloat16)
    assert torch.equal(kernels.int8_rows(ids, pack(q), scales), want)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernels.int8_rows(torch.tensor([64]), pack(q), scales)


def test_the_torch_path_is_chosen_or_fallen_back_to(monkeypatch, caplog):
    assert load_kernels("torch", "cpu") is None
    assert load_kernels("auto", "cuda") is None

    def no_compiler(**_):
        raise OSError("g++: not found")
    monkeypatch.setattr("ember.kernels.build_cpu_ops", no_compiler)
    with caplog.at_level(logging.WARNING, logger="ember.kernels"):
        assert load_kernels("auto", "cpu") is None
    assert "g++: not found" in caplog.text and "--kernels torch" in caplog.text


PROMPTS = [[1, 9038, 2501, 263] * k for k in (1, 5, 12)] + [[1, 415, 3413, 3441] * 30]


def test_tiny_llama_float32_greedy_tokens_equal_with_and_without_kernels(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for choice in ("torch", "auto"):
        llm = LLM(str(folder), dtype="float32", kernels=choice, max_num_batched_tokens=64)
        assert (llm.engine.runner.model.model.norm.kernels is None) == (choice == "torch")
        outputs[choice] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert outputs["auto"] == outputs["torch"]


@pytest.mark.parametrize(("chunk", "kv_cache_dtype"), [
    pytest.param(None, "model", marks=pytest.mark.heavy),
    pytest.param(32, "model", marks=pytest.mark.heavy),   # chunked prompts
    (32, "int8")])       # chunked, and an int8 cache: written, read in the kernels
def test_smollm_bfloat16_kernels_agree_by_the_closeness_rule(smollm_path, chunk,
                                                             kv_cache_dtype):
    """bfloat16 with and without the kernels (decode and, with AVX-512 BF16, prefill
    attention, fresh and continued chunks)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    prompts = [[1, 504, 3458, 282, 4649, 314]] + PROMPTS[1:]
    options = {"kv_cache_dtype": kv_cache_dtype}
    if chunk is not None:
        options["max_num_batched_tokens"] = chunk
    outputs = {choice: LLM(str(smollm_path), dtype="bfloat16", quantization="none",
                           kernels=choice, **options).generate(prompts, params)
               for choice in ("torch", "auto")}
    assert_greedy_close(outputs["torch"], outputs["auto"])


def test_smollm_default_weights_agree_with_and_without_kernels(smollm_path):
    """The shipped format (int4 layers, int8 output projection): with the kernels the output
    projection runs on int8_linear and the tied embedding is read from its int8 weight (no
    bfloat16 table kept); without them, torch's packed kernels and the bfloat16 table."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    prompts = [[1, 504, 3458, 282, 4649, 314]] + PROMPTS[1:]
    engines = {choice: LLM(str(smollm_path), kernels=choice) for choice in ("torch", "auto")}
    model = engines["auto"].engine.runner.model
    if kernels_have_bf16_dot(engines["auto"]):
        assert type(model.model.embed_tokens).__name__ == "Int8Embedding"
        assert not any(t.dtype == torch.bfloat16 and t.shape[0] == 49152
                       for t in model.state_dict().values())
    outputs = {choice: llm.generate(prompts, params) for choice, llm in engines.items()}
    assert_greedy_close(outputs["torch"], outputs["auto"])


def kernels_have_bf16_dot(llm: LLM) -> bool:
    kernels = llm.engine.runner.model.model.norm.kernels
    return kernels is not None and kernels.has_bf16_dot


@pytest.mark.parametrize("kv_cache_dtype", [pytest.param("model", marks=pytest.mark.heavy),
                                            "int8"])   # (the default cache)
def test_smollm_decode_stack_equals_the_layers(smollm_path, kv_cache_dtype):
    """The default weights on AVX-512 BF16: decode-only steps run every layer in one
    compiled call (decode_stack). Up to 8 rows the layers run the same int4 kernels in the
    same order; beyond, both run the int8 prompt-path weights on the same int8 tiles (with
    AVX-512 VNNI; else the layers run the dense copies and the two agree by the closeness
    rule). So tokens and logprobs are bit-for-bit the same. The same with an int8 KV cache,
    which both quantize and read alike."""
    llm = LLM(str(smollm_path), kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    if not kernels_have_bf16_dot(llm):
        pytest.skip("the decode stack needs AVX-512 BF16")
    assert model.decode_stack is not None
    int8_decode = model.int8_decode    # on VNNI CPUs: the stack has the int8 weights
    assert int8_decode == model.model.layers[0].mlp.down_proj.int8_quads
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    cold = RequestOptions(prefix_cache=False)
    small = [PROMPTS[:1], PROMPTS]                                        # 1 and 4 rows
    big = [[1, 504 + i, 3458, 282] * (1 + i) for i in range(11)]         # 11 rows
    rows_seen = []
    forward = model.decode_stack.forward

    def counted(x, *args):
        rows_seen.append(x.shape[0])
        return forward(x, *args)

    model.decode_stack = SimpleNamespace(forward=counted,
                                         forward_mixed=model.decode_stack.forward_mixed)
    stacked = [llm.generate(prompts, params, cold) for prompts in small + [big]]
    assert 1 in rows_seen and 4 in rows_seen and 11 in rows_seen, sorted(set(rows_seen))
    model.decode_stack = None
    layered = [llm.generate(prompts, params, cold) for prompts in small + [big]]
    exact = 3 if int8_decode else 2
    for got, want in zip(stacked[:exact], layered[:exact]):
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert_greedy_close(layered[2], stacked[2])


@pytest.mark.parametrize("kv_cache_dtype", [pytest.param("model", marks=pytest.mark.heavy),
                                            "int8"])   # (the default cache)
def test_smollm_prompt_steps_through_the_stack_equal_the_layers(smollm_path, kv_cache_dtype):
    """With the int8 prompt matmuls (AVX-512 VNNI), steps with prompt chunks run every layer
    in one call too (forward_mixed): fresh chunks, chunks continued over the cache and
    decodes beside them, on the kernels the layers call, in the same order. A step budget of
    64 tokens cuts the prompts into chunks beside the decodes of the shorter ones; tokens and
    logprobs equal the layers' bit for bit, and only steps the stack cannot lay out (a
    continued chunk of 16 tokens or fewer) ran layer by layer."""
    llm = LLM(str(smollm_path), kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    if not kernels_have_bf16_dot(llm) or not model.int8_decode:
        pytest.skip("prompt steps in the stack need AVX-512 BF16 and VNNI")
    stack, calls = model.decode_stack, {"mixed": 0, "layers": 0}

    def mixed(*args):
        calls["mixed"] += 1
        return stack.forward_mixed(*args)

    layer_forward = model.model.layers[0].forward

    def first_layer(*args):
        calls["layers"] += 1
        return layer_forward(*args)

    model.model.layers[0].forward = first_layer
    lengths = [5, 40, 150, 300, 90, 17, 2, 230]
    prompts = [[100 + (7 * i + 3 * j) % 20000 for j in range(n)] for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    cold = RequestOptions(prefix_cache=False)
    model.decode_stack = SimpleNamespace(forward=stack.forward, forward_mixed=mixed)
    stacked = llm.generate(prompts, params, cold)
    assert calls["mixed"] >= 10 and calls["layers"] <= 2, calls
    model.decode_stack = None
    layered = llm.generate(prompts, params, cold)
    for got, want in zip(stacked, layered):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs


@pytest.fixture(scope="module")
def bf16_cache_llm(smollm_path):
    """The default model over bfloat16 KV caches (no scales)."""
    return LLM(str(smollm_path), kv_cache_dtype="model")


def test_decode_stack_refuses_inputs_that_do_not_fit(bf16_cache_llm):
    llm = bf16_cache_llm
    stack = llm.engine.runner.model.decode_stack
    if stack is None:
        pytest.skip("the decode stack needs AVX-512 BF16")
    caches = [c.data for c in llm.engine.runner.kv_caches]
    x = torch.zeros(1, 576, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    one = torch.tensor([1])
    tables = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        stack.forward(x, cos, sin, caches[:-1], [], one, tables, one)
    with pytest.raises(RuntimeError, match="a slot is outside the cache"):
        stack.forward(x, cos, sin, caches, [], torch.tensor([1 << 40]), tables, one)
    with pytest.raises(RuntimeError, match=r"x must be \[T, hidden\]"):
        stack.forward(x.float(), cos, sin, caches, [], one, tables, one)
    with pytest.raises(RuntimeError, match="kv_scales"):
        stack.forward(x, cos, sin, caches, [torch.zeros(1)], one, tables, one)
    none = torch.zeros(0, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="row 0 must be a decode or in one chunk"):
        stack.forward_mixed(x, cos, sin, caches, [], one, 0, none, none[:, 0],
                            torch.zeros(0, 4, dtype=torch.long), [])
    chunk = torch.tensor([[0, 2, 2, 1]])
    with pytest.raises(RuntimeError, match="chunk 0: its rows must lie in the step"):
        stack.forward_mixed(x, cos, sin, caches, [], one, 0, none, none[:, 0], chunk,
                            [torch.zeros(1, dtype=torch.long)])
    with pytest.raises(RuntimeError, match="row 0 must be a decode or in one chunk, once"):
        stack.forward_mixed(x, cos, sin, caches, [], one, 0, tables, one,
                            torch.tensor([[0, 1, 1, 1]]), [torch.zeros(1, dtype=torch.long)])
    with pytest.raises(RuntimeError, match="a block id is outside the cache"):
        stack.forward_mixed(x, cos, sin, caches, [], one, 0, none, none[:, 0],
                            torch.tensor([[0, 1, 1, 1]]), [torch.tensor([1 << 40])])


def test_decode_stack_looks_rope_rows_up_at_positions(bf16_cache_llm):
    """Given positions, the stack takes each row's cos and sin from the tables (the model's
    RoPE cache) itself: the same output, bit for bit, as given the rows; a position outside
    the tables, or a count that is not the rows', is refused."""
    llm = bf16_cache_llm
    model = llm.engine.runner.model
    stack = model.decode_stack
    if stack is None:
        pytest.skip("the decode stack needs AVX-512 BF16")
    caches = [c.data for c in llm.engine.runner.kv_caches]
    cos, sin = model.rope_cache
    positions = torch.tensor([5, 0, 17])
    block_tables = torch.tensor([[0, 0], [1, 0], [2, 3]])
    seq_lens = positions + 1
    slots = torch.tensor([5, 16, 3 * 16 + 1])
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = stack.forward(x, cos[positions], sin[positions], caches, [], slots, block_tables,
                         seq_lens)
    got = stack.forward(x, cos, sin, caches, [], slots, block_tables, seq_lens, positions)
    assert torch.equal(got, want)
    past = torch.tensor([5, 0, cos.shape[0]])
    with pytest.raises(RuntimeError, match=f"position {cos.shape[0]} is outside the RoPE"):
        stack.forward(x, cos, sin, caches, [], slots, block_tables, seq_lens, past)
    with pytest.raises(RuntimeError, match=r"positions must be \[T\]"):
        stack.forward(x, cos, sin, caches, [], slots, block_tables, seq_lens, positions[:2])


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (33, 130, 96), (256, 576, 960)])
def test_brgemm_linear_is_the_bfloat16_matmul(kernels, m, k, n):
    """brgemm_linear (torch's brgemm: oneDNN's ukernel on AMX, a GEMM per block elsewhere)
    against F.linear in float32, rounded to bfloat16 once, strided rows too. Where it runs
    the ukernel (the only place it is a prefill candidate), a row's output must not depend on
    the rows beside it (prompt rows' numerics: docs/architecture.md); the fallback GEMM
    blocks its sums by the number of rows (seen on AVX-512 at k = 576)."""
    g = torch.Generator().manual_seed(m + k + n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]   # rows strided
    blocks = kernels.brgemm_pack(w)
    assert blocks.shape == (n // 32, k, 32)
    y = kernels.brgemm_linear(x, blocks)
    want = F.linear(x.float(), w.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    close(y, want, torch.bfloat16)
    assert (y.float() - want).abs().max() <= (want.bfloat16().float() - want).abs().max() + \
        1e-3 * want.abs().max()   # float32 sums: bfloat16's one rounding, little more
    for rows in (slice(0, 1), slice(m // 2, m // 2 + 1), slice(m - 1, m)):
        assert torch.equal(kernels.brgemm_linear(x[rows], blocks), y[rows]) or \
            not kernels.brgemm_vnni


def test_brgemm_needs_outputs_in_32s_and_even_inputs(kernels):
    with pytest.raises(RuntimeError, match="outputs in 32s and even inputs"):
        kernels.brgemm_pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="outputs in 32s and even inputs"):
        kernels.brgemm_pack(torch.zeros(64, 63, dtype=torch.bfloat16))
