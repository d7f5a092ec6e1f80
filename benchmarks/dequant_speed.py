"""How fast GGUF block formats dequantize: MB of GGUF bytes per second, per ggml type.

    PYTHONPATH=. .venv/bin/python benchmarks/dequant_speed.py [--mb 100] [--threads 2]
        [--rounds 5] [--reference-mb 8] [--out results/dequant_speed.json]
        [--gguf FILE... [--dtype bfloat16]]

Each type gets --mb of random blocks (random bytes with the f16 scale fields set to finite
values, so no NaN, infinity or subnormal scale changes the float speed), dequantized with
torch on --threads threads two ways, the best of --rounds each (the median too, in the JSON;
on a shared machine the best round is the one least slowed by other processes):
  load     ember.quant.formats.dequantize into a new float32 tensor, as loading a model does
           (the first touch of the new tensor's pages is part of the cost: 4-12 bytes of
           float32 per byte of GGUF);
  bf16     the same into a new bfloat16 tensor, each chunk rounded while in cache, as loading
           a bfloat16 model does;
  kernels  the same chunks into one float32 buffer reused across rounds: the kernels alone.
Beside them, the `gguf` package's numpy dequantizer on --reference-mb (0 skips it).
With --gguf FILE..., each whole file is read as the loader reads it instead (every tensor
dequantized to --dtype, the best of --rounds): MB of file per second.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

from ember.quant.formats import CHUNK_VALUES, KERNELS, dequantize
from ember.weights.gguf import GGUFFile

# byte offsets of each type's f16 fields within a block
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
              Q.IQ4_NL: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}


def random_blocks(qtype: Q, num_bytes: int, rng: np.random.Generator) -> np.ndarray:
    """[num_blocks, bytes per block] uint8 of random valid blocks, about num_bytes in all."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    n = max(1, num_bytes // block_bytes)
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(1e-3, 1e-2, n).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(n, 2)
    return raw


def seconds(fn, rounds: int) -> tuple[float, float]:
    """(best, median) seconds of `rounds` calls."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def measure(qtype: Q, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    values_per_block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, args.mb * 10**6, rng)
    shape = (raw.shape[0] * values_per_block,)
    t, t_median = seconds(lambda: dequantize(raw, qtype, shape), args.rounds)
    b, b_median = seconds(lambda: dequantize(raw, qtype, shape, torch.bfloat16), args.rounds)
    blocks, out = torch.from_numpy(raw), torch.zeros(raw.shape[0], values_per_block)
    step = max(1, CHUNK_VALUES // values_per_block)

    def kernels_only() -> None:
        for start in range(0, len(blocks), step):
            KERNELS[qtype](blocks[start:start + step], out[start:start + step])

    kernels_only()  # touches the buffer's pages once, outside the timing
    k, k_median = seconds(kernels_only, args.rounds)
    mb = raw.nbytes / 1e6
    row = {"type": qtype.name, "mb": mb, "seconds": t, "mb_per_s": mb / t,
           "median_mb_per_s": mb / t_median, "values_per_s": shape[0] / t,
           "bf16_mb_per_s": mb / b, "bf16_median_mb_per_s": mb / b_median,
           "kernels_mb_per_s": mb / k, "kernels_median_mb_per_s": mb / k_median}
    if args.reference_mb:
        small = random_blocks(qtype, args.reference_mb * 10**6, rng)
        ref, _ = seconds(lambda: quants.dequantize(small, qtype), 1)
        row["gguf_numpy_mb_per_s"] = small.nbytes / 1e6 / ref
    return row


def measure_file(path: Path, dtype: torch.dtype, rounds: int) -> dict:
    """Seconds to read every tensor of a GGUF file as the loader does."""
    file = GGUFFile(path)
    config = file.model_config()

    def read_all() -> None:
        for _, tensor in file.tensors(config, dtype):
            del tensor

    best, median = seconds(read_all, rounds)
    mb = path.stat().st_size / 1e6
    return {"file": str(path), "mb": mb, "seconds": best, "mb_per_s": mb / best,
            "median_mb_per_s": mb / median, "dtype": str(dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reference-mb", type=int, default=8)
    parser.add_argument("--types", default=",".join(t.name for t in KERNELS))
    parser.add_argument("--gguf", nargs="*", default=[], help="whole files to read instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for path in args.gguf:
        rows.append(measure_file(Path(path).expanduser(), getattr(torch, args.dtype),
                                 args.rounds))
        print(f"{Path(path).name}: {rows[-1]['mb']:.1f} MB in {rows[-1]['seconds']:.3f} s, "
              f"{rows[-1]['mb_per_s']:.1f} MB/s (median {rows[-1]['median_mb_per_s']:.1f})",
              flush=True)
    if args.gguf:
        args.types = ""
    for name in filter(None, args.types.split(",")):
        row = measure(Q[name], args, rng)
        rows.append(row)
        ref = f"  (gguf numpy {row['gguf_numpy_mb_per_s']:7.1f} MB/s)" \
            if "gguf_numpy_mb_per_s" in row else ""
        print(f"{row['type']:7s} load {row['mb_per_s']:7.1f} MB/s of GGUF "
              f"({row['values_per_s'] / 1e6:5.1f} M values/s)  bf16 "
              f"{row['bf16_mb_per_s']:7.1f} MB/s  kernels "
              f"{row['kernels_mb_per_s']:7.1f} MB/s{ref}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"threads": args.threads, "rounds": args.rounds,
                                              "load_average": os.getloadavg(), "rows": rows},
                                             indent=2))


if __name__ == "__main__":
    main()
