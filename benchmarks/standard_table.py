"""Markdown table of benchmarks/standard.sh results (the medians `ember bench peers` wrote).

    .venv/bin/python benchmarks/standard_table.py results/standard
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [("a-one-stream", "a: one stream, input 32, output 256"),
        ("b-ttft-1024", "b: input 1024, output 1"),
        ("c-mixed-c8", "c: 64 req, in U(100,400), out U(64,192), conc 8"),
        ("c-mixed-c32", "c: same, concurrency 32"),
        ("d-shared-prefix", "d: 32 req, shared 600-token prefix + 20, out 32, conc 8")]
FIGURES = [("output tok/s", ("output_tok_per_s",), 1), ("TTFT p50 ms", ("ttft_s", "p50"), 1000),
           ("TPOT p50 ms", ("tpot_s", "p50"), 1000), ("chunk gap p99 ms",
                                                      ("chunk_gap_s", "p99"), 1000),
           ("E2E p50 ms", ("e2e_s", "p50"), 1000)]


def get(summary: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        summary = (summary or {}).get(key)
    return summary


def main(folder: str) -> None:
    print("| workload | figure | ember | " + " | ".join(["peer", "ember / peer"]) + " |")
    print("|---|---|---:|---:|---:|")
    for stem, title in ROWS:
        path = Path(folder) / f"{stem}.json"
        if not path.exists():
            continue
        medians = json.loads(path.read_text())["median"]
        peer = next(name for name in medians if name != "ember")
        for label, key, scale in FIGURES:
            mine, theirs = get(medians["ember"], key), get(medians[peer], key)
            if not mine or not theirs or (stem.startswith("b") and "TPOT" in label):
                continue
            print(f"| {title} | {label} | {mine * scale:.1f} | {theirs * scale:.1f} | "
                  f"{mine / theirs:.2f} |")
            title = ""


if __name__ == "__main__":
    main(sys.argv[1])
