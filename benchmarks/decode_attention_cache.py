"""Decode attention over a cold cache: what a decode step at concurrency ~20 pays for its K/V.

    .venv/bin/python benchmarks/decode_attention_cache.py [--out FILE]

SmolLM2-135M's shapes (9 query / 3 KV heads of 64, 30 layers): one cache per layer, together
~1 GiB on transparent huge pages as the engine allocates them (engine/memory.py), 21
requests of U(200, 400) tokens whose blocks are scattered through it. A "step" is the
kernel once per layer, so that each layer finds its K/V out of the CPU's caches, as in a real
step (the weights stream through between two visits of a layer). "hot" runs the first
layer's cache 30 times instead: its blocks stay in L2/L3, which leaves the kernel's own work.
Best of 5 steps, for bfloat16 and int8 caches, 16- and 128-token blocks.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ember.engine.memory import huge_page_zeros
from ember.kernels import CpuKernels, build_cpu_ops
from ember.models.attention import quantize_int8

HEADS, KV_HEADS, D, LAYERS = 9, 3, 64, 30
CACHE_TOKENS = 46_592          # a 1 GiB budget of bfloat16 K/V on this model
REQUESTS, LONGEST = 21, 400    # the concurrency-32 workload's mean decode batch and context


def make_caches(dtype: str, block_size: int, g: torch.Generator
                ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    shape = (2, KV_HEADS, CACHE_TOKENS // block_size, block_size, D)
    caches, scales = [], []
    for _ in range(LAYERS):
        x = torch.randn(shape, generator=g) * 0.3
        if dtype == "int8":
            q, s = quantize_int8(x.view(2 * KV_HEADS, -1, D).transpose(0, 1))
            cache = huge_page_zeros(shape, torch.int8, "cpu")
            scale = huge_page_zeros(shape[:-1], torch.float16, "cpu")
            cache.copy_(q.transpose(0, 1).reshape(shape))
            scale.copy_(s.transpose(0, 1).reshape(shape[:-1]))
        else:
            cache, scale = huge_page_zeros(shape, torch.bfloat16, "cpu"), None
            cache.copy_(x.to(torch.bfloat16))
        caches.append(cache)
        scales.append(scale)
    return caches, scales


def step_ms(kernels: CpuKernels, q: torch.Tensor, caches: list, scales: list,
            tables: torch.Tensor, lens: torch.Tensor) -> float:
    def step() -> None:
        for cache, scale in zip(caches, scales):
            kernels.decode_attention(q, cache, tables, lens, D ** -0.5, scale)
    step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def block_tables(placement: str, blocks: int, width: int, g: torch.Generator) -> torch.Tensor:
    """[REQUESTS, width] block ids: drawn at random, or one run of adjacent blocks per request
    (the runs themselves at random places)."""
    if placement == "random":
        return torch.randperm(blocks, generator=g)[:REQUESTS * width].view(REQUESTS, width)
    starts = torch.randperm(blocks // width, generator=g)[:REQUESTS] * width
    return starts[:, None] + torch.arange(width)[None, :]


def measure(kernels: CpuKernels, dtype: str, block_size: int,
            placements: tuple[str, ...]) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    caches, scales = make_caches(dtype, block_size, g)
    width = -(-LONGEST // block_size)
    lens = torch.randint(LONGEST // 2, LONGEST + 1, (REQUESTS,), generator=g)
    q = torch.randn(REQUESTS, HEADS, D, generator=g).to(torch.bfloat16)
    row_bytes = D * (1 if dtype == "int8" else 2) + (2 if dtype == "int8" else 0)
    kv_mb = int(lens.sum()) * KV_HEADS * 2 * row_bytes * LAYERS / 1e6
    results = {}
    for placement in placements:
        tables = block_tables(placement, CACHE_TOKENS // block_size, width, g).contiguous()
        cold = step_ms(kernels, q, caches, scales, tables, lens)
        hot = step_ms(kernels, q, [caches[0]] * LAYERS, [scales[0]] * LAYERS, tables, lens)
        results[placement] = {"kv_mb_per_step": kv_mb, "cold_ms": cold, "hot_ms": hot,
                              "cold_gb_s": kv_mb / cold, "cold_over_hot": cold / hot}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    kernels = CpuKernels(build_cpu_ops())
    if not kernels.has_bf16_dot:
        raise SystemExit("these kernels need AVX-512 BF16")
    results = {}
    for dtype in ("bfloat16", "int8"):
        for block_size, placements in ((16, ("random", "contiguous")), (128, ("random",))):
            for placement, r in measure(kernels, dtype, block_size, placements).items():
                name = f"{dtype} cache, {block_size}-token blocks, {placement}"
                results[name] = r
                print(f"{name:46} {r['kv_mb_per_step']:4.0f} MB of K/V per step: cold "
                      f"{r['cold_ms']:5.2f} ms ({r['cold_gb_s']:4.1f} GB/s), hot "
                      f"{r['hot_ms']:5.2f} ms ({r['cold_over_hot']:.1f}x)", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(),
                                              "requests": REQUESTS, "results": results},
                                             indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
