"""Multi-turn chat and the prefix cache: prompt tokens recomputed per turn vs the turn's new
tokens (target: recomputed <= new + one block).

    .venv/bin/ember bench serve --workload chat-sessions --sessions 4 --turns 6 \
        --input-len fixed:60 --output-len fixed:40 --concurrency 4 --out chat.json
    .venv/bin/python benchmarks/chat_recompute.py chat.jsonl

For turn t of a session: new(t) = prompt(t) - prompt(t-1) - output(t-1) (the user's message
and the template's framing; the previous answer was computed while it was generated), and
recomputed(t) = prompt(t) - cached(t), from the server's usage counts.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jsonl")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    sessions = defaultdict(list)
    failed = 0
    for line in Path(args.jsonl).read_text().splitlines():
        row = json.loads(line)
        if row.get("error"):
            failed += 1
            continue
        sessions[row["session"]].append(row)
    if failed or not sessions:
        raise SystemExit(f"{failed} failed requests and {len(sessions)} sessions in "
                         f"{args.jsonl}: rerun the benchmark (is --base-url .../v1 right?)")
    print("| session | turn | prompt | cached | recomputed | new | recomputed <= new + block |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    worst, ok_all = 0, True
    for s, rows in sorted(sessions.items()):
        rows.sort(key=lambda r: r["turn"])
        for prev, row in zip(rows, rows[1:]):
            new = row["prompt_tokens"] - prev["prompt_tokens"] - prev["output_tokens"]
            recomputed = row["prompt_tokens"] - (row["cached_tokens"] or 0)
            ok = recomputed <= new + args.block_size
            ok_all &= ok
            worst = max(worst, recomputed - new)
            print(f"| {s} | {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | "
                  f"{recomputed} | {new} | {'yes' if ok else 'NO'} |")
    print(f"\nall turns within new + {args.block_size}: {ok_all}; "
          f"worst recomputed - new = {worst}")


if __name__ == "__main__":
    main()
