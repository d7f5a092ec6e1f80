"""The compiled CPU kernels (ember/kernels) beside the torch code they replace, per call.
(For prompt matmuls, "torch" is oneDNN's bfloat16 matmul and "kernel" the int8 one.)

    .venv/bin/python benchmarks/cpu_kernels.py [--source SOURCE] [--out FILE]

`--source`: the kernels' sources to build (a folder like ember/kernels/cpu, or one .cpp
file, as benchmarks/kernel_ab.py takes them); the installed ones by default.

bfloat16, torch's threads, SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads of 64,
intermediate 1536), 16-token blocks scattered over a 2000-block cache. Best of 3 timings of
many calls each. The cache is small enough to stay in the CPU's caches: in a real step at
batch 32 the decode kernel reads its K and V from DRAM and is bound by that bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.bench.cli import results_dir
from ember.kernels import SOURCE, CpuKernels, build_cpu_ops
from ember.models.attention import PagedKV, _matmul_attention
from ember.quant.packed import KernelInt8Linear, PackedLinear

DTYPE, HIDDEN, HEADS, KV_HEADS, D, BLOCK, BLOCKS = torch.bfloat16, 576, 9, 3, 64, 16, 2000
VOCAB = 49152


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def norms(kernels: CpuKernels) -> dict[str, dict[str, float]]:
    x, residual = torch.randn(1, HIDDEN, dtype=DTYPE), torch.randn(1, HIDDEN, dtype=DTYPE)
    weight = torch.rand(HIDDEN, dtype=DTYPE) + 0.5
    return {
        "rms_norm [1, 576]": {
            "torch_us": per_call_us(lambda: F.rms_norm(x, (HIDDEN,), weight, 1e-5), 3000),
            "kernel_us": per_call_us(lambda: kernels.rms_norm(x, weight, 1e-5), 3000)},
        "residual add + rms_norm [1, 576]": {
            "torch_us": per_call_us(lambda: F.rms_norm(x + residual, (HIDDEN,), weight, 1e-5),
                                    3000),
            "kernel_us": per_call_us(lambda: kernels.rms_norm(x, weight, 1e-5, residual),
                                     3000)}}


def decode_attention(kernels: CpuKernels, members: int, context: int) -> dict[str, float]:
    """The torch path (gather the context through the block tables, two matmuls) against
    the kernel reading the blocks in place."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKV(torch.randn(2, KV_HEADS, BLOCKS, BLOCK, D, generator=g).to(DTYPE))
    width = -(-context // BLOCK)
    tables = torch.stack([torch.randperm(BLOCKS, generator=g)[:width] for _ in range(members)])
    seq_lens = torch.full((members,), context, dtype=torch.long)
    bias = torch.zeros(members, 1, 1, width * BLOCK)
    bias[..., context:] = float("-inf")
    q = torch.randn(members, HEADS, D, generator=g).to(DTYPE)
    small = members * width * BLOCK <= 1024  # the torch path's float32 choice for small groups

    def torch_path() -> torch.Tensor:
        k, v = cache.gather(tables, torch.float32 if small else DTYPE)
        return _matmul_attention(q[:, None], k, v, bias, D ** -0.5)

    calls = 3000 if members == 1 else 200
    return {"torch_us": per_call_us(torch_path, calls),
            "kernel_us": per_call_us(lambda: kernels.decode_attention(
                q, cache.data, tables, seq_lens, D ** -0.5), calls)}


def prefill_attention(kernels: CpuKernels, new: int, context: int) -> dict[str, float]:
    """A prompt chunk of `new` tokens, the last of `context`: the torch path (PyTorch's CPU
    SDPA on the chunk's own k and v when it is the whole context, i.e. a fresh chunk; on the
    gathered context under a causal mask otherwise) against the kernel over the blocks."""
    g = torch.Generator().manual_seed(1)
    cache = PagedKV(torch.randn(2, KV_HEADS, BLOCKS, BLOCK, D, generator=g).to(DTYPE))
    width = -(-context // BLOCK)
    table = torch.randperm(BLOCKS, generator=g)[:width]
    q = torch.randn(new, HEADS, D, generator=g).to(DTYPE)
    keys, values = cache.gather(table[None], DTYPE)
    keys, values = keys[:, 0, :context][None], values[:, 0, :context][None]
    mask = torch.arange(context)[None, :] <= torch.arange(context - new, context)[:, None]
    queries = q.transpose(0, 1)[None]

    def torch_path() -> torch.Tensor:
        if new == context:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                  scale=D ** -0.5, enable_gqa=True)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                              scale=D ** -0.5, enable_gqa=True)

    return {"torch_us": per_call_us(torch_path, 20),
            "kernel_us": per_call_us(lambda: kernels.prefill_attention(
                q, cache.data, table, context, D ** -0.5), 20)}


def elementwise(kernels: CpuKernels, tokens: int) -> dict[str, dict[str, float]]:
    """SwiGLU's activation over a prefill chunk's rows."""
    x = torch.randn(tokens, 2 * 1536, dtype=DTYPE)
    gate, up = x[:, :1536], x[:, 1536:]
    return {f"silu * up [{tokens}, 1536]": {
        "torch_us": per_call_us(lambda: F.silu(gate) * up, 50),
        "kernel_us": per_call_us(lambda: kernels.silu_and_mul(x), 50)}}


def output_projection(kernels: CpuKernels, rows: int) -> dict[str, float]:
    """The int8 output projection [rows, 576] -> [rows, 49152] logits: without the kernel,
    PackedLinear (torch's packed int8 kernel up to 8 rows, the bfloat16 table above, which
    oneDNN reorders on each call as it is the embedding too); with it, int8_linear."""
    linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(DTYPE)
    packed = PackedLinear(linear, "int8", prepack_dense=False)
    kernel = KernelInt8Linear(linear, kernels)
    x = torch.randn(rows, HIDDEN, dtype=DTYPE)
    calls = 200 if rows == 1 else 30
    return {"torch_us": per_call_us(lambda: packed(x).float(), calls),
            "kernel_us": per_call_us(lambda: kernel(x), calls)}


def int4_linear(kernels: CpuKernels, rows: int, n: int, k: int) -> dict[str, float]:
    """An int4 decoder-layer linear at decode sizes: torch's packed int4 kernel against
    int4_linear (PackedLinear built without and with the kernels). The weight stays in the
    CPU's caches here; in a step the 30 layers' 66 MB come from DRAM."""
    linear = torch.nn.Linear(k, n, bias=False).to(DTYPE)
    plain = PackedLinear(linear, "int4", keep_dense=False)
    kernel = PackedLinear(linear, "int4", keep_dense=False, kernels=kernels)
    x = torch.randn(rows, k, dtype=DTYPE)
    return {"torch_us": per_call_us(lambda: plain(x), 500),
            "kernel_us": per_call_us(lambda: kernel(x), 500)}


def prompt_matmul(kernels: CpuKernels, rows: int, n: int, k: int) -> dict[str, float]:
    """A prompt chunk's matmul: the dense bfloat16 weight on oneDNN (prepacked) against int8
    activations on the SmoothQuant int8 weight (w8a8_linear: quantize, oneDNN's int8 GEMM,
    dequantize); for gate/up (n = 3072) SwiGLU's silu * up included on both sides."""
    linear = torch.nn.Linear(k, n, bias=False).to(DTYPE)
    dense = PackedLinear(linear, "int4", kernels=kernels, max_packed_rows=0)
    int8 = PackedLinear(linear, "int4", kernels=kernels, max_packed_rows=0)
    int8.use_int8_dense(kernels, torch.ones(k))
    x = torch.randn(rows, k, dtype=DTYPE)
    if n == 3072:
        return {"torch_us": per_call_us(lambda: kernels.silu_and_mul(dense(x)), 50),
                "kernel_us": per_call_us(lambda: int8.swiglu(x), 50)}
    return {"torch_us": per_call_us(lambda: dense(x), 50),
            "kernel_us": per_call_us(lambda: int8(x), 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out_dir = results_dir(os.environ, Path.home())  # never the tree
    parser.add_argument("--out", default=str(out_dir / "cpu_kernels.json"))
    parser.add_argument("--source", type=Path, default=SOURCE)
    args = parser.parse_args()
    other = args.source.resolve() != SOURCE.resolve()   # built apart: the cached build stays
    kernels = CpuKernels(build_cpu_ops(source=args.source,
                                       name="ember_cpu_kernels_source" if other else None))
    results = norms(kernels)
    for members, context in ((1, 180), (1, 1000), (32, 300)):
        results[f"decode attention, {members} x {context} tokens"] = decode_attention(
            kernels, members, context)
    if kernels.has_bf16_dot:
        for new, context in ((512, 512), (512, 1024), (64, 1024)):
            results[f"prefill attention, {new} of {context} tokens"] = prefill_attention(
                kernels, new, context)
    results.update(elementwise(kernels, 512))
    if kernels.has_bf16_dot:
        for rows in (1, 8, 32):
            results[f"int8 output projection, {rows} rows"] = output_projection(kernels, rows)
        for rows in (1, 8):
            for n, k in ((3072, 576), (576, 1536), (960, 576)):
                results[f"int4 linear {k}->{n}, {rows} rows"] = int4_linear(kernels, rows, n, k)
        for rows in (64, 256, 512):
            for n, k in ((960, 576), (576, 576), (3072, 576)):
                results[f"prompt matmul {k}->{n}, {rows} rows"] = prompt_matmul(kernels, rows,
                                                                               n, k)
    print(f"{'op':40}{'torch us':>12}{'kernel us':>12}")
    for name, r in results.items():
        print(f"{name:40}{r['torch_us']:12.1f}{r['kernel_us']:12.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(),
                                          "dtype": str(DTYPE), "ops": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
