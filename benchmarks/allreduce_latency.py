"""All-reduce latency by message size: shared memory against gloo, the ranks on one host.

    .venv/bin/python benchmarks/allreduce_latency.py [--ranks 2] [--out FILE]

ember/distributed/allreduce.py's two transports (both add in rank order, so they return the
same bits). Each rank is pinned to a core of its own where there are enough
(os.sched_setaffinity), with torch's threads at 1; gloo runs over a TCP store on a free
port. Per size: warm-up calls, then many back-to-back calls on every rank; the figure is
the median (and 90th percentile) of one call's time, the larger of the ranks' medians.
Sizes: a decode step's hidden state (576, SmolLM2-135M's hidden size) at 1, 8 and 32 rows
in float32 and bfloat16, then float32 tensors up to 4 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.bench.cli import results_dir
from ember.distributed.allreduce import make_all_reduce
from ember.kernels import build_cpu_ops

HIDDEN = 576
SIZES = ([(HIDDEN * rows, torch.float32) for rows in (1, 8, 32)]
         + [(HIDDEN * rows, torch.bfloat16) for rows in (1, 8, 32)]
         + [(kib * 256, torch.float32) for kib in (64, 256, 1024, 4096)])
KINDS = ("shm", "gloo")


def calls_for(nbytes: int) -> int:
    """Enough calls for a steady median, fewer for the large tensors."""
    return max(50, min(3000, (64 << 20) // max(nbytes, 1)))


def time_calls(all_reduce, numel: int, dtype: torch.dtype, calls: int) -> list[float]:
    """Seconds per call, back to back, after warm-up calls."""
    x = torch.ones(numel, dtype=dtype)
    for _ in range(min(calls, 100)):
        all_reduce(x.fill_(1))
    times = []
    for _ in range(calls):
        x.fill_(1)
        start = time.perf_counter()
        all_reduce(x)
        times.append(time.perf_counter() - start)
    return times


def rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=300))
    transports = {kind: make_all_reduce(None, rank, world_size, kind) for kind in KINDS}
    rows = []
    for numel, dtype in SIZES:
        nbytes = numel * dtype.itemsize
        for kind, all_reduce in transports.items():
            dist.barrier()
            times = sorted(time_calls(all_reduce, numel, dtype, calls_for(nbytes)))
            median, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
            worst = [None] * world_size
            dist.all_gather_object(worst, (median, p90))
            rows.append({"kind": kind, "numel": numel, "dtype": str(dtype).split(".")[-1],
                         "bytes": nbytes, "calls": len(times),
                         "median_us": max(m for m, _ in worst) * 1e6,
                         "p90_us": max(p for _, p in worst) * 1e6})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor()


def table(rows: list[dict]) -> str:
    lines = ["| size | bytes | shm median (p90) µs | gloo median (p90) µs |",
             "|---|---:|---:|---:|"]
    for numel, dtype in SIZES:
        got = {r["kind"]: r for r in rows
               if r["numel"] == numel and r["dtype"] == str(dtype).split(".")[-1]}
        shape = (f"{numel // HIDDEN} x {HIDDEN}" if numel % HIDDEN == 0 else f"{numel}")
        lines.append(f"| {shape} {got['shm']['dtype']} | {got['shm']['bytes']} | "
                     + " | ".join(f"{got[k]['median_us']:.1f} ({got[k]['p90_us']:.1f})"
                                  for k in KINDS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=str(results_dir(os.environ, Path.home())
                                             / "allreduce_latency.json"))
    args = parser.parse_args()
    build_cpu_ops()   # once, before the ranks load it
    load_before = os.getloadavg()
    rows_file = Path(args.out).with_suffix(".rows.json")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(args.ranks, free_port(), str(rows_file)), nprocs=args.ranks)
    rows = json.loads(rows_file.read_text())
    rows_file.unlink()
    report = {"ranks": args.ranks, "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
              "load_before": load_before, "load_after": os.getloadavg(), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{args.ranks} ranks, {report['cpu']}, {report['cores']} cores, load average "
          f"{load_before[0]:.2f} before, {report['load_after'][0]:.2f} after")
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
