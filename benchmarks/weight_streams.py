"""How fast the decode stack's weights can stream at batch 1, by access pattern.

    .venv/bin/python benchmarks/weight_streams.py [--rounds 12] [--out FILE]

The stack's 120 int4 weights (random, SmolLM2-135M's shapes, side by side in huge pages, as
ember keeps them) are read five ways, each after a 256 MB read that evicts them, rounds
alternating:
  plain       one read over the same bytes laid end to end, each thread half of it;
  regions     per weight (q, then its scales) a parallel region, each thread summing its
              half: the matmuls' pattern with nothing but a sum for compute;
  barriers    the same halves in one parallel region, a barrier after each weight;
  one_region  the same halves in one parallel region, no barrier;
  kernel      int4_linear at one row over the weights, from Python (the decode stack calls
              the same kernel from C++, without Python's ~2-5 us a call).
The three summing reads also run with a software prefetch 1 KiB ahead (`_pf`). What it
tells: the share of a plain read's rate that the pattern itself leaves (the weights split
into 240 short streams, and threads waiting for each other at each weight's end), before
the kernel's own cost. Reported: GB/s (the median round) per way, and the threads' hand-off
(a cache line's round trip between them, as `ember roofline` reports it).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from kernel_ab import report

from ember.engine.memory import huge_page_zeros, move_to_huge_pages
from ember.engine.roofline import hand_off_probe
from ember.kernels import CpuKernels, build_cpu_ops, pack_int4_panels

SUM_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <immintrin.h>
#include <chrono>

static __m512i sum_range(const char* p, int64_t bytes, __m512i acc, int64_t ahead) {
  for (int64_t i = 0; i < bytes; i += 64) {
    if (ahead > 0) _mm_prefetch(p + i + ahead, _MM_HINT_T1);
    acc = _mm512_add_epi64(acc, _mm512_loadu_si512(p + i));
  }
  return acc;
}

// Thread t's half of buffer b (whole cache lines).
static std::pair<int64_t, int64_t> half(const torch::Tensor& b, int t) {
  const int64_t n = b.numel() / 64 * 64, mid = (b.numel() / 2) / 64 * 64;
  return t == 0 ? std::make_pair<int64_t, int64_t>(0, int64_t(mid)) : std::make_pair(mid, n);
}

// mode 0: a parallel region per buffer; 1: one region, a barrier after each buffer; 2: one
// region, no barriers. Returns seconds.
double sum_halves(std::vector<torch::Tensor> bufs, int64_t mode, int64_t ahead) {
  const auto start = std::chrono::steady_clock::now();
  int64_t total = 0;
  auto part = [&](const torch::Tensor& b, int t, __m512i acc) {
    const auto [a, e] = half(b, t);
    return sum_range(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()) + a, e - a, acc,
                     ahead);
  };
  if (mode == 0) {
    for (const auto& b : bufs) {
      int64_t s = 0;
#pragma omp parallel num_threads(2) reduction(+ : s)
      s += _mm512_reduce_add_epi64(part(b, omp_get_thread_num(), _mm512_setzero_si512()));
      total += s;
    }
  } else {
#pragma omp parallel num_threads(2) reduction(+ : total)
    {
      __m512i acc = _mm512_setzero_si512();
      for (const auto& b : bufs) {
        acc = part(b, omp_get_thread_num(), acc);
        if (mode == 1) {
#pragma omp barrier
        }
      }
      total += _mm512_reduce_add_epi64(acc);
    }
  }
  volatile int64_t sink = total;
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
"""

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30   # qkv, o, gate_up, down


def side_by_side(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` moved side by side into one huge-page buffer by move_to_huge_pages, as the
    engine moves the model's weights (a buffer each, the small ones got no huge pages and
    read slower: 23.9-24.9 GB/s against 27.3-28.0 for the regions, probe)."""
    holder = torch.nn.Module()
    for i, t in enumerate(tensors):
        holder.register_buffer(f"t{i}", t)
    move_to_huge_pages([(holder, f"t{i}") for i in range(len(tensors))])
    return [getattr(holder, f"t{i}") for i in range(len(tensors))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ext = load_inline("ember_weight_streams", cpp_sources=SUM_SOURCE, functions=["sum_halves"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
    ops = build_cpu_ops()
    g = torch.Generator().manual_seed(0)
    weights, flat = [], []
    for n, k in SHAPES:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // 32, generator=g) / 100
        weights.append(pack_int4_panels(q, scale, -8 * scale) + (k,))
    packed = side_by_side([t for qp, sm, _ in weights for t in (qp, sm)])
    weights = [(qp, sm, k) for qp, sm, (_, _, k) in zip(packed[::2], packed[1::2], weights)]
    for qp, sm, _ in weights:
        flat += [qp.view(-1), sm.view(torch.uint8).view(-1)]
    total = sum(t.numel() for t in flat)
    whole = huge_page_zeros((total,), torch.uint8, "cpu").random_(0, 255)
    evict = huge_page_zeros((64 << 20,), torch.float32, "cpu").uniform_()
    xs = {k: torch.randn(1, k, generator=g).bfloat16() for k in (576, 1536)}

    def kernel() -> float:
        start = time.perf_counter()
        for qp, sm, k in weights:
            ops.int4_linear(xs[k], qp, sm)
        return time.perf_counter() - start

    ways = {"plain": lambda pf: ext.sum_halves([whole], 2, pf),
            "regions": lambda pf: ext.sum_halves(flat, 0, pf),
            "barriers": lambda pf: ext.sum_halves(flat, 1, pf),
            "one_region": lambda pf: ext.sum_halves(flat, 2, pf)}
    tests = {name: (lambda f=f: f(0)) for name, f in ways.items()}
    tests |= {f"{name}_pf": (lambda f=f: f(1024)) for name, f in ways.items()}
    tests["kernel"] = kernel
    rounds = []
    for _ in range(args.rounds + 2):
        row = {}
        for name, test in tests.items():
            evict.sum()
            row[name] = test()
        rounds.append(row)
    rounds = rounds[2:]   # the first two warm the code paths
    gb_s = {name: total / statistics.median(r[name] for r in rounds) / 1e9 for name in tests}
    result = {"bytes": total, "rounds": args.rounds, "gb_s": gb_s,
              **hand_off_probe(CpuKernels(ops))()}   # where the VM put the two vCPUs
    report(result, args.out)


if __name__ == "__main__":
    main()
