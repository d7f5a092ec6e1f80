"""Disaggregated serving's shared-memory pull against a plain memcpy of the same bytes.

    .venv/bin/python benchmarks/kv_transfer_shm.py [--tokens 4000] [--out FILE]

A "prefill" process allocates SmolLM2-135M's KV cache (30 layers, 3 KV heads of 64, blocks
of 16 tokens) in shared memory as a `--role prefill` replica does (ember/kv_transfer/shm.py),
fills it, and a "decode" process maps it and copies one prompt's blocks into its own cache
with the connector's own copy (blocks.copy_blocks), as a decode replica's pull does: the
compiled one (ember/kernels/cpu/kv_copy.cpp), and torch's (`torch_*`, --kernels torch). The
baseline is torch's copy of one contiguous buffer of the same bytes into another, in the
decode process. Caches in bfloat16 and int8 (with its float16 scales); blocks adjacent on
both sides (a prompt's blocks usually are), in runs of 16 and 4, and scattered. Each
figure is the median of `--repeats` copies into a cache whose pages are already in memory,
with torch at one thread (a pull runs beside the engine's own steps); the first pull after
mapping (its page tables filled as it reads) is reported apart.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember.kernels import CpuKernels, build_cpu_ops
from ember.kv_transfer.blocks import block_nbytes, copy_blocks
from ember.kv_transfer.shm import Mappings, SharedKV

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16   # SmolLM2-135M
CACHE_BLOCKS = 4096                                   # 64k tokens on each side


def shapes(kind: str, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    data = (2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    if kind == "int8":
        return [s for _ in range(LAYERS) for s in ((data, torch.int8),
                                                   (data[:-1], torch.float16))]
    return [(data, torch.bfloat16) for _ in range(LAYERS)]


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, their calls interleaved (a shared machine's load
    then weighs on all alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def runs_of(rng: random.Random, run: int, num_blocks: int) -> list[tuple[int, int]]:
    """Block pairs in runs of `run` blocks adjacent on both sides, the runs anywhere in the
    two caches (a pool after much churn; 1: every block scattered)."""
    num_runs = -(-num_blocks // run)
    starts = zip(rng.sample(range(CACHE_BLOCKS // run), num_runs),
                 rng.sample(range(CACHE_BLOCKS // run), num_runs))
    return [(s * run + i, d * run + i) for s, d in starts for i in range(run)][:num_blocks]


def decode_side(where: dict, kind: str, num_blocks: int, repeats: int) -> dict:
    """In the decode process: map, copy (first pull, then warm), and the memcpy baseline."""
    torch.set_num_threads(1)
    local = [torch.zeros(s, dtype=d) for s, d in shapes(kind, CACHE_BLOCKS)]
    for t in local:
        t.fill_(1)   # the decode replica's cache is in memory already
    rng = random.Random(0)
    src_ids = list(range(100, 100 + num_blocks))
    layouts = {"adjacent": list(zip(src_ids, range(2000, 2000 + num_blocks)))} | {
        f"runs_of_{run}": runs_of(rng, run, num_blocks) for run in (16, 4, 1)}
    nbytes = num_blocks * block_nbytes(local)
    kernels = CpuKernels(build_cpu_ops())   # built by the parent: imported as it is
    start = time.perf_counter()
    src = Mappings().tensors(where)
    first = copy_blocks(src, local, layouts["adjacent"], kernels)
    first_s = time.perf_counter() - start
    assert first == nbytes
    check = layouts["adjacent"][3]
    assert all(torch.equal(s[:, :, check[0]], d[:, :, check[1]]) for s, d in zip(src, local))
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    fns = {"memcpy": lambda: b.copy_(a)}
    for name, pairs in layouts.items():
        fns[name] = lambda pairs=pairs: copy_blocks(src, local, pairs, kernels)
        fns[f"torch_{name}"] = lambda pairs=pairs: copy_blocks(src, local, pairs)
    seconds = timed(fns, repeats)
    out = {"bytes": nbytes, "first_pull_gbps": nbytes / first_s / 1e9}
    for name, s in seconds.items():
        out[f"{name}_gbps"] = nbytes / s / 1e9
        if name != "memcpy":
            out[f"{name}_vs_memcpy"] = seconds["memcpy"] / s
    return out


def run(kind: str, tokens: int, repeats: int) -> dict:
    build_cpu_ops()
    shared = SharedKV(shapes(kind, CACHE_BLOCKS))
    for t in shared.tensors:   # the prefill replica's computed prompt
        t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    code = ("import json, sys; from benchmarks.kv_transfer_shm import decode_side; "
            "print(json.dumps(decode_side(json.loads(sys.argv[1]), sys.argv[2], "
            "int(sys.argv[3]), int(sys.argv[4]))))")
    num_blocks = -(-tokens // BLOCK)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(shared.describe()), kind,
                           str(num_blocks), str(repeats)], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parent.parent)
    return {"kv_cache_dtype": kind, "tokens": tokens} | json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {"cpu": platform.processor() or platform.machine(),
               "runs": [run(kind, args.tokens, args.repeats) for kind in ("bfloat16", "int8")]}
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
