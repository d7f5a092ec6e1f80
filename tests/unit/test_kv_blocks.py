"""Moving KV blocks between two caches of one layout (ember/kv_transfer/blocks.py): the
reference is plain indexing of the source block by block, for both the copy (few runs and
scattered blocks) and the byte stream, in bf16 and int8-with-scales layouts; the compiled
copy (ember/kernels/cpu/kv_copy.cpp) against the torch copy, byte for byte."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.kernels import CpuKernels, build_cpu_ops
from ember.kv_transfer.blocks import BlockWriter, copy_blocks, read_blocks, runs


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return CpuKernels(build_cpu_ops())  # a failed build is a failure here, not a skip


def caches(num_blocks: int, int8: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = (2, 3, num_blocks, 4, 8)
    if int8:   # two layers: values, then their scales
        return [t for _ in range(2) for t in (
            torch.randint(-127, 128, data, generator=g, dtype=torch.int8),
            torch.rand(data[:-1], generator=g).to(torch.float16))]
    return [torch.randn(data, generator=g).to(torch.bfloat16) for _ in range(3)]


def test_runs_join_pairs_adjacent_on_both_sides():
    assert runs([(3, 10), (4, 11), (5, 13), (9, 14)]) == [(3, 10, 2), (5, 13, 1), (9, 14, 1)]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("scattered", [False, True])
def test_copy_and_stream_move_exactly_the_blocks(int8, scattered):
    rng = random.Random(int(int8) * 2 + int(scattered))
    src, dst = caches(40, int8, 1), caches(50, int8, 2)
    if scattered:
        pairs = list(zip(rng.sample(range(40), 20), rng.sample(range(50), 20)))
    else:
        pairs = [(5 + i, 30 + i) for i in range(10)] + [(20 + i, 2 + i) for i in range(7)]
    before = [t.clone() for t in dst]
    copy_blocks(src, dst, pairs)
    streamed = [t.clone() for t in before]
    writer = BlockWriter(streamed, [d for _, d in pairs])
    for chunk in read_blocks(src, [s for s, _ in pairs]):
        writer.write([chunk[:7], chunk[7:]])   # pieces need not fall on block bounds
    assert writer.complete
    want = [t.clone() for t in before]
    for s, d in pairs:
        for a, w in zip(src, want):
            w[:, :, d] = a[:, :, s]
    for got in (dst, streamed):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bytes_past_the_last_block_are_refused():
    src, dst = caches(4, False, 1), caches(4, False, 2)
    writer = BlockWriter(dst, [1])
    chunk = next(read_blocks(src, [0]))
    with pytest.raises(ValueError):
        writer.write([chunk + b"x"])


def random_bytes(num_blocks: int, int8: bool, seed: int) -> list[torch.Tensor]:
    """A cache of `caches`' layout filled with random bytes (NaNs and all: the copy moves
    bytes, never values)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g,
                          dtype=torch.uint8).view(t.dtype).view(t.shape)
            for t in caches(num_blocks, int8, seed)]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def pairs_of(rng: random.Random, layout: str, num_pairs: int, src_blocks: int,
             dst_blocks: int) -> list[tuple[int, int]]:
    """Distinct blocks on each side: adjacent on both sides, in runs of random lengths at
    random places, or a random permutation (each block scattered)."""
    if layout == "adjacent":
        s, d = rng.randrange(src_blocks - num_pairs + 1), rng.randrange(dst_blocks - num_pairs + 1)
        return [(s + i, d + i) for i in range(num_pairs)]
    if layout == "scattered":
        return list(zip(rng.sample(range(src_blocks), num_pairs),
                        rng.sample(range(dst_blocks), num_pairs)))
    free_src, free_dst, pairs = list(range(src_blocks)), list(range(dst_blocks)), []
    while len(pairs) < num_pairs:   # a run from a random free block, while both sides are free
        s, d = rng.choice(free_src), rng.choice(free_dst)
        for i in range(rng.randint(1, num_pairs - len(pairs))):
            if s + i not in free_src or d + i not in free_dst:
                break
            free_src.remove(s + i)
            free_dst.remove(d + i)
            pairs.append((s + i, d + i))
    return pairs


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.sampled_from(["adjacent", "runs", "scattered"]),
       st.integers(0, 30))
def test_the_compiled_copy_equals_the_torch_copy(kernels, seed, int8, layout, num_pairs):
    rng = random.Random(seed)
    src = random_bytes(40, int8, seed)
    pairs = pairs_of(rng, layout, num_pairs, 40, 50)
    got, want = random_bytes(50, int8, seed + 1), random_bytes(50, int8, seed + 1)
    assert copy_blocks(src, got, pairs, kernels) == copy_blocks(src, want, pairs)
    assert same_bytes(got, want)


def test_the_compiled_copy_follows_strided_heads(kernels):
    """Views strided or offset in their first two dims (every other head; the last two)
    copy as torch's indexing copies them."""
    src = [t[:, ::2] for t in random_bytes(20, True, 3)]
    got, want = random_bytes(30, True, 4), random_bytes(30, True, 4)
    pairs = [(3, 7), (4, 8), (19, 0), (0, 29)]
    copy_blocks(src, [t[:, 1:] for t in got], pairs, kernels)
    for a, w in zip(src, [t[:, 1:] for t in want]):   # block by block (the views'
        for s, d in pairs:                            # gathered copy would need reshapes)
            w[:, :, d] = a[:, :, s]
    assert same_bytes(got, want)


def test_the_compiled_copy_refuses_what_it_cannot_copy_and_moves_nothing(kernels):
    src, dst = random_bytes(10, False, 5), random_bytes(12, False, 6)
    before = [t.clone() for t in dst]
    refused = {
        "a block outside the source": (src, dst, [(1, 1), (10, 2)]),
        "a block outside the destination": (src, dst, [(1, 1), (2, 12)]),
        "unpacked rows": ([t[..., ::2] for t in src], [t[..., ::2] for t in dst], [(0, 0)]),
        "blocks of another size": (src, [t[:, :, :, :2] for t in dst], [(0, 0)]),
        "a tensor missing": (src[:2], dst, [(0, 0)]),
        "the source itself": (src, src, [(0, 1)]),
    }
    for why, (a, b, pairs) in refused.items():
        with pytest.raises(RuntimeError):
            copy_blocks(a, b, pairs, kernels)
            pytest.fail(why)
    assert same_bytes(dst, before)
