"""Markdown table of benchmarks/standard.sh results (the medians `ember bench peers` wrote),
one pair of columns per peer.

    .venv/bin/python benchmarks/standard_table.py ~/.cache/ember/bench/standard
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
    files = [(stem, title, Path(folder) / f"{stem}.json") for stem, title in ROWS]
    files = [(stem, title, json.loads(path.read_text())["median"])
             for stem, title, path in files if path.exists()]
    if not files:
        raise SystemExit(f"no benchmarks/standard.sh results in {folder}")
    peers = [name for name in files[0][2] if name != "ember"]
    print("| workload | figure | ember | " +
          " | ".join(f"{p} | ember / {p}" for p in peers) + " |")
    print("|---|---|---:|" + "---:|---:|" * len(peers))
    for stem, title, medians in files:
        for label, key, scale in FIGURES:
            mine = get(medians["ember"], key)
            theirs = [get(medians.get(p), key) for p in peers]
            if not mine or not all(theirs) or (stem.startswith("b") and "TPOT" in label):
                continue
            cells = " | ".join(f"{t * scale:.1f} | {mine / t:.2f}" for t in theirs)
            print(f"| {title} | {label} | {mine * scale:.1f} | {cells} |")
            title = ""


if __name__ == "__main__":
    main(sys.argv[1])
