"""The engine step behind workload d's time to first token, in-process: 8 requests of a cached
600-token prefix + 20 new tokens each, against the same requests with the prefix cache off.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prefix_step.py [--rounds 10] [--out FILE]

Each round adds the 8 requests (their 20 new tokens random, seeded by the round) and steps the
engine until they have their first token. Reported per round: wall time and the process's CPU
time. On a machine shared with other work the CPU time is the steadier figure (one thread:
no time lost waiting for a descheduled partner thread); the ratio cached / uncached of the
medians is the prefill work a prefix-cache hit leaves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ember.bench.cli import results_dir
from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.request import RequestOptions, SamplingParams

CORPUS = Path(__file__).resolve().parents[1] / "ember" / "bench" / "data" / "corpus.txt"


def one_round(engine: EngineCore, prefix: list[int], seed: int, cached: bool,
              batch: int, suffix_len: int) -> tuple[float, float, int]:
    """Wall and CPU seconds until every request of the round has its first token, and steps."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=1)
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(batch):
        suffix = torch.randint(100, engine.model_config.vocab_size - 100, (suffix_len,),
                               generator=g).tolist()
        engine.add_request(f"{seed}-{i}-{cached}", prefix + suffix, params,
                           RequestOptions(prefix_cache=cached))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - wall, time.process_time() - cpu, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=600)
    parser.add_argument("--suffix-len", type=int, default=20)
    parser.add_argument("--out", default=str(results_dir(os.environ, Path.home())
                                             / "prefix-step.json"))
    args = parser.parse_args()
    engine = EngineCore(EngineConfig.from_options())
    prefix = engine.tokenizer.encode(CORPUS.read_text())[:args.prefix_len]
    one_round(engine, prefix, 0, True, 1, args.suffix_len)      # caches the prefix
    runs: dict[str, list[tuple[float, float, int]]] = {"cached": [], "uncached": []}
    for r in range(1, args.rounds + 1):   # alternating, so that drift hits both alike
        for name in ("cached", "uncached"):
            runs[name].append(one_round(engine, prefix, r, name == "cached", args.batch,
                                        args.suffix_len))
    summary = {name: {"wall_ms_p50": 1e3 * statistics.median(x[0] for x in rounds),
                      "cpu_ms_p50": 1e3 * statistics.median(x[1] for x in rounds),
                      "steps": rounds[0][2]} for name, rounds in runs.items()}
    summary["cpu_ratio"] = summary["cached"]["cpu_ms_p50"] / summary["uncached"]["cpu_ms_p50"]
    summary["wall_ratio"] = (summary["cached"]["wall_ms_p50"]
                             / summary["uncached"]["wall_ms_p50"])
    summary["threads"] = torch.get_num_threads()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary,
                                          "runs": runs}, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
