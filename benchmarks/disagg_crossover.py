"""Where splitting a prompt starts to pay: decode streams while prompts of one length L arrive,
through one prefill and one decode replica, each L's prompts split (computed on the prefill
replica, their KV pulled over shared memory) against kept whole on the decode replica.

    .venv/bin/python benchmarks/disagg_crossover.py [--lengths 128,256,512,1024,2048]
        [--rounds 2] [--out-dir DIR]

One `ember route --prefill-replicas 1 --decode-replicas 1` (a core each) starts the replicas
and splits every prompt of at least --split-min-tokens (the streams' short chat prompts stay
whole on the decode replica); a second gateway over the same two replicas
(`--replica-url URL#prefill --replica-url URL#decode`) keeps every prompt whole on the decode
replica (`--disagg-min-tokens` above any prompt). Both never step aside (`--disagg-idle-s 0`).
Each run is `ember bench serve --workload mixed` with --long-len L; the two ways alternate
within each round and take the same seeded prompts, each run under its own `cache_salt` so
that no run finds another's prompts cached. The gateways' request counts by path and the
decode replica's transfer fallbacks are checked after each run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from ember.bench.cli import results_dir

KEEP_WHOLE = 1_000_000   # --disagg-min-tokens above any prompt: nothing is split
MODES = ("split", "whole")


def start_route(port: int, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ember.cli", "route", "--port",
                                 str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_fleet(url: str, proc: subprocess.Popen, replicas: int, timeout_s: float = 600
               ) -> list[dict]:
    """The gateway's replicas once `replicas` of them are ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway at {url} exited")
        try:
            fleet = httpx.get(url + "/fleet", timeout=5).json()["replicas"]
            if sum(r["state"] == "ready" for r in fleet) >= replicas:
                return fleet
        except (httpx.TransportError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the gateway at {url} never had {replicas} ready replicas")


def metric(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if re.match(re.escape(name) + r"[{ ]", line) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def counts(gateways: dict[str, str], decode_url: str) -> dict[str, float]:
    out = {f"{mode}_{path}": metric(url, "ember_router_disagg_requests_total",
                                    f'path="{path}"')
           for mode, url in gateways.items() for path in ("prefill_decode", "kept_local")}
    out["decode_fallbacks"] = metric(decode_url, "ember_kv_transfer_fallbacks_total")
    out["decode_loads"] = metric(decode_url, "ember_kv_transfer_loads_total")
    return out


def bench(url: str, length: int, seed: int, salt: str, out: Path, a: argparse.Namespace
          ) -> dict:
    cmd = [sys.executable, "-m", "ember.cli", "bench", "serve", "--base-url", url + "/v1",
           "--workload", "mixed", "--streams", str(a.streams),
           "--input-len", f"fixed:{a.stream_input_len}",
           "--stream-output-len", str(a.stream_output_len), "--long-prompts",
           str(a.long_prompts), "--long-len", str(length), "--long-every", str(a.long_every),
           "--long-output-len", str(a.long_output_len), "--seed", str(seed),
           "--extra-body", json.dumps({"cache_salt": salt}), "--label", salt,
           "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def stream_gaps(jsonl: Path) -> list[float]:
    gaps = []
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "stream" and not record.get("error"):
            times = record["chunk_times"]
            gaps += [b - t for t, b in zip(times, times[1:])]
    return gaps


def row(summary: dict, stall_s: float) -> dict:
    gaps = stream_gaps(Path(summary["jsonl"]))
    kinds = summary["by_kind"]
    return {"gap_p50_ms": 1e3 * kinds["stream"]["chunk_gap_s"]["p50"],
            "gap_p99_ms": 1e3 * kinds["stream"]["chunk_gap_s"]["p99"],
            "gap_max_ms": 1e3 * max(gaps),
            "stalled_gaps_pct": 100 * float(np.mean(np.array(gaps) > stall_s)),
            "long_ttft_p50_s": kinds["long"]["ttft_s"]["p50"],
            "long_ttft_p99_s": kinds["long"]["ttft_s"]["p99"],
            "output_tok_per_s": summary["output_tok_per_s"],
            "failed": summary.get("failed", 0)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="128,256,512,1024,2048")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-input-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=640)
    p.add_argument("--long-prompts", type=int, default=8)
    p.add_argument("--long-every", type=float, default=1.5)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--split-min-tokens", type=int, default=100,
                   help="the split gateway's --disagg-min-tokens: above the streams' prompts "
                        "(chat template included), at most the shortest length")
    p.add_argument("--prefill-tokens-with-decodes", type=int, default=256,
                   help="the replicas' prompt tokens a step beside decodes (a decode "
                        "replica's own default is 64)")
    p.add_argument("--stall-ms", type=float, default=100.0,
                   help="a stream's gap longer than this counts as stalled")
    p.add_argument("--port", type=int, default=8760)
    p.add_argument("--out-dir", default=str(results_dir(os.environ, Path.home())
                                            / "disagg-crossover"),
                   help="each run's summary, the gateways' logs and result.json")
    p.add_argument("--table", default=None, metavar="RESULT_JSON",
                   help="only print the table of an earlier run's result.json")
    return p.parse_args()


def run(a: argparse.Namespace, out_dir: Path) -> dict:
    urls = {"split": f"http://127.0.0.1:{a.port}", "whole": f"http://127.0.0.1:{a.port + 1}"}
    # every prompt split (no backlog rule), and each step's prompt tokens as the table's runs
    procs = [start_route(a.port, ["--prefill-replicas", "1", "--decode-replicas", "1",
                                  "--disagg-min-tokens", str(a.split_min_tokens),
                                  "--disagg-idle-s", "0", "--disagg-max-prefill-backlog", "0",
                                  "--prefill-tokens-with-decodes",
                                  str(a.prefill_tokens_with_decodes), "-q"],
                         out_dir / "split.log")]
    try:
        fleet = wait_fleet(urls["split"], procs[0], 2)
        role = {r["role"]: r["url"] for r in fleet}
        procs.append(start_route(a.port + 1, [
            "--replica-url", role["prefill"] + "#prefill", "--replica-url",
            role["decode"] + "#decode", "--disagg-min-tokens", str(KEEP_WHOLE),
            "--disagg-idle-s", "0"], out_dir / "whole.log"))
        wait_fleet(urls["whole"], procs[1], 2)
        runs = []
        for rnd in range(a.rounds):
            for i, length in enumerate(map(int, a.lengths.split(","))):
                order = MODES if (rnd + i) % 2 == 0 else MODES[::-1]
                for mode in order:
                    before = counts(urls, role["decode"])
                    salt = f"r{rnd}-L{length}-{mode}"
                    summary = bench(urls[mode], length, rnd + 1, salt,
                                    out_dir / f"{salt}.json", a)
                    after = counts(urls, role["decode"])
                    delta = {k: after[k] - before[k] for k in after}
                    runs.append({"round": rnd, "length": length, "mode": mode,
                                 **row(summary, a.stall_ms / 1e3), "paths": delta,
                                 "loadavg": os.getloadavg()})
                    print(json.dumps(runs[-1]), flush=True)
                    result = {"cpu": platform.processor() or platform.machine(),
                              "args": vars(a), "runs": runs}
                    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
        return result
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def joined(runs: list[dict], key: str, spec: str) -> str:
    return ", ".join(spec.format(r[key]) for r in runs)


def mean_ratio(split: list[dict], whole: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in split]) / np.mean([r[key] for r in whole]))


def table(result: dict) -> str:
    """Per length, each way's figures over the rounds, and split / whole of their means."""
    lines = ["| L | way | streams' gap p50 / p99 ms | stalled gaps % | max gap ms | "
             "L-prompts' TTFT p50 s | output tok/s |", "|---|---|---|---|---|---|---|"]
    for length in sorted({r["length"] for r in result["runs"]}):
        by_mode = {mode: [r for r in result["runs"] if r["length"] == length
                          and r["mode"] == mode] for mode in MODES}
        for mode, rs in by_mode.items():
            lines.append(f"| {length} | {mode} | {joined(rs, 'gap_p50_ms', '{:.1f}')} / "
                         f"{joined(rs, 'gap_p99_ms', '{:.1f}')} | "
                         f"{joined(rs, 'stalled_gaps_pct', '{:.2f}')} | "
                         f"{joined(rs, 'gap_max_ms', '{:.0f}')} | "
                         f"{joined(rs, 'long_ttft_p50_s', '{:.2f}')} | "
                         f"{joined(rs, 'output_tok_per_s', '{:.1f}')} |")
        ratio = {k: mean_ratio(by_mode["split"], by_mode["whole"], k)
                 for k in ("gap_p99_ms", "long_ttft_p50_s", "output_tok_per_s")}
        lines.append(f"| {length} | split / whole | p99 **{ratio['gap_p99_ms']:.2f}x** | | | "
                     f"**{ratio['long_ttft_p50_s']:.2f}x** | {ratio['output_tok_per_s']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    a = parse()
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(table(run(a, out_dir)))


if __name__ == "__main__":
    main()
