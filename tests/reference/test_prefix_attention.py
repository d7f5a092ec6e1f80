"""Prompt chunks that share a cached prefix: the prefill kernel packs the shared keys once for
all of them (prefill_attention_chunks, and the decode stack's prompt steps).

Reference: each chunk attended alone by prefill_attention (bit for bit), that in turn against
the gathered context attended with the torch matmul path in float32; and whole engines with
the shared prefix through the decode stack against the layers run one by one.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ember import LLM
from ember.kernels import CpuKernels, build_cpu_ops
from ember.models.attention import PagedKV, _matmul_attention, quantize_int8
from ember.request import RequestOptions, SamplingParams

HEADS, KV_HEADS = 9, 3


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    ops = CpuKernels(build_cpu_ops())
    if not ops.has_bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16: prompt chunks take the torch path")
    return ops


def make_cache(int8: bool, num_blocks: int, block_size: int, head_dim: int,
               g: torch.Generator) -> PagedKV:
    x = torch.randn(2, KV_HEADS, num_blocks, block_size, head_dim, generator=g)
    if not int8:
        return PagedKV(x.to(torch.bfloat16))
    q, scale = quantize_int8(x.view(-1, block_size, head_dim))
    return PagedKV(q.view(x.shape), scale.view(x.shape[:-1]))


def reference(q: torch.Tensor, cache: PagedKV, table: torch.Tensor, seq_len: int
              ) -> torch.Tensor:
    """q [n, heads, d]: the last n of seq_len tokens, causal over the gathered context
    (rounded to bfloat16 as the kernel packs it), float32 matmul attention."""
    n, block_size = q.shape[0], cache.block_size
    width = -(-seq_len // block_size)
    k, v = (x.to(torch.bfloat16).float()
            for x in cache.gather(table[None, :width], torch.float32))
    keys = torch.arange(width * block_size)
    queries = torch.arange(seq_len - n, seq_len)
    bias = torch.zeros(1, 1, n, width * block_size)
    bias.masked_fill_((keys[None, :] > queries[:, None])[None, None], float("-inf"))
    return _matmul_attention(q.float()[None], k, v, bias, q.shape[-1] ** -0.5)[0]


def shared_prefix_chunks(block_size: int, g: torch.Generator
                         ) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """(new tokens, seq_len) and block tables of six chunks: three after one 13-block
    prefix, one sharing only its first 5 blocks (the group then shares those), one fresh
    chunk, one over blocks of its own."""
    blocks = torch.randperm(80, generator=g)
    prefix, rest = blocks[:13], iter(blocks[13:].tolist())
    ctx = 13 * block_size
    shapes = [(20, ctx + 20), (33, ctx + 40), (1, ctx + 1), (17, 5 * block_size + 30),
              (24, 24), (9, 3 * block_size + 9)]
    tables = []
    for i, (_, seq_len) in enumerate(shapes):
        width = -(-seq_len // block_size)
        head = prefix[:5] if i == 3 else prefix if i < 3 else torch.tensor([], dtype=torch.long)
        own = [next(rest) for _ in range(width - len(head))]
        tables.append(torch.cat([head, torch.tensor(own, dtype=torch.long)]))
    return shapes, tables


@pytest.mark.parametrize(("int8", "block_size", "head_dim"), [
    (False, 16, 64), (True, 16, 64), (False, 8, 128), (True, 12, 64)])
def test_chunks_sharing_a_prefix_attend_as_each_alone(kernels, int8, block_size, head_dim):
    g = torch.Generator().manual_seed(21)
    cache = make_cache(int8, 80, block_size, head_dim, g)
    shapes, tables = shared_prefix_chunks(block_size, g)
    rows = sum(n for n, _ in shapes) + 3     # three rows in no chunk, between the chunks
    q = torch.randn(rows, HEADS, head_dim, generator=g).to(torch.bfloat16)
    out = torch.full_like(q, 7.0)
    info, first = [], 1
    for n, seq_len in shapes:
        info.append([first, n, seq_len])
        first += n + (1 if len(info) % 2 == 0 else 0)
    kernels.ops.prefill_attention_chunks(q, cache.data, torch.tensor(info), tables,
                                         head_dim ** -0.5, cache.scale, out)
    covered = torch.zeros(rows, dtype=torch.bool)
    for (first, n, seq_len), table in zip(info, tables):
        rows_c = slice(first, first + n)
        covered[rows_c] = True
        alone = kernels.prefill_attention(q[rows_c], cache.data, table, seq_len,
                                          head_dim ** -0.5, cache.scale)
        assert torch.equal(out[rows_c], alone), (first, n, seq_len)
        torch.testing.assert_close(alone.float(), reference(q[rows_c], cache, table, seq_len),
                                   atol=2e-2, rtol=2e-2)
    assert torch.equal(out[~covered], torch.full_like(out[~covered], 7.0))


def test_chunks_refuse_rows_outside_q_or_in_two_chunks(kernels):
    g = torch.Generator().manual_seed(22)
    cache = make_cache(False, 10, 16, 64, g)
    q = torch.randn(8, HEADS, 64, generator=g).to(torch.bfloat16)
    table = torch.arange(2)
    with pytest.raises(RuntimeError, match="in two chunks"):
        kernels.ops.prefill_attention_chunks(q, cache.data, torch.tensor([[0, 4, 20],
                                                                          [3, 4, 20]]),
                                             [table, table], 0.125, None, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="lie in q"):
        kernels.ops.prefill_attention_chunks(q, cache.data, torch.tensor([[6, 4, 20]]),
                                             [table], 0.125, None, torch.empty_like(q))


@pytest.mark.parametrize(("kv_cache_dtype", "suffix_len"),
                         [pytest.param("model", 20, marks=pytest.mark.heavy), ("int8", 20),
                          pytest.param("int8", 6, marks=pytest.mark.heavy)])
def test_shared_prefix_steps_through_the_stack_equal_the_layers(smollm_path, kv_cache_dtype,
                                                                suffix_len):
    """Six prompts of one cached 200-token prefix (192 tokens in whole blocks) and 20 tokens
    each, or 6 (chunks of 14 new tokens, as few as a decode group takes): their chunks
    attend in one prompt step of the decode stack, over the prefix packed once (they share
    its blocks); tokens and logprobs equal the layers run one by one (each chunk attended
    alone, packing its whole context), bit for bit."""
    llm = LLM(str(smollm_path), kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    if model.decode_stack is None or not model.int8_decode:
        pytest.skip("prompt steps in the stack need AVX-512 BF16 and VNNI")
    prefix = [100 + (13 * j) % 20000 for j in range(200)]
    prompts = [prefix + [300 + 50 * i + j for j in range(suffix_len)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    stack, shared_steps = model.decode_stack, []

    def mixed(*args):
        tables = args[10]   # chunk_tables
        shared_steps.append(sum(int(t[0]) == int(tables[0][0]) for t in tables))
        return stack.forward_mixed(*args)

    def run(salt: str) -> list:
        options = RequestOptions(cache_salt=salt)
        llm.generate([prefix + [7]], params, options)   # caches the prefix
        return llm.generate(prompts, params, options)

    model.decode_stack = SimpleNamespace(forward=stack.forward, forward_mixed=mixed)
    stacked = run("stack")
    assert max(shared_steps) == 6, shared_steps
    model.decode_stack = None
    layered = run("layers")
    for got, want in zip(stacked, layered):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs


def test_chunks_of_long_shared_contexts_attend_in_parts_as_each_alone(kernels):
    """Four chunks over a shared 11,968-token prefix: their packed copies would pass the
    kernel's 64 MiB at once (each chunk's context alone ~18 MiB at head_dim 128), so the call
    goes in halves, each sharing the prefix within itself; every chunk as it gets alone."""
    g = torch.Generator().manual_seed(23)
    cache = make_cache(False, 760, 16, 128, g)
    prefix = torch.arange(748)
    tables = [torch.cat([prefix, torch.tensor([748 + i])]) for i in range(4)]
    q = torch.randn(8, HEADS, 128, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    info = torch.tensor([[2 * i, 2, 748 * 16 + 2] for i in range(4)])
    kernels.ops.prefill_attention_chunks(q, cache.data, info, tables, 128 ** -0.5, None, out)
    for (first, n, seq_len), table in zip(info.tolist(), tables):
        alone = kernels.prefill_attention(q[first:first + n], cache.data, table, seq_len,
                                          128 ** -0.5)
        assert torch.equal(out[first:first + n], alone)
