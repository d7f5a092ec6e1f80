"""Output tok/s with LoRA adapters mixed in one batch, beside the base model alone.

    .venv/bin/python benchmarks/lora_mix.py --start            # starts `ember serve` itself
    .venv/bin/python benchmarks/lora_mix.py --base-url URL     # a server with adapters a0..a3

Writes four random rank-R adapters on every projection of the served model (PEFT format),
serves them with --lora, then runs `ember bench` at --concurrency twice, base-only and with
the requests spread over the adapters, alternating the two `--rounds` times (after
`--warmup` uncounted rounds), and prints the ratio of output token throughputs (median of
rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from ember.lora.adapter import write_random_adapter
from ember.weights.loader import open_model_files

def bench(base_url: str, models: str, args: argparse.Namespace, out: Path) -> float:
    cmd = [sys.executable, "-m", "ember.cli", "bench", "serve", "--base-url", base_url,
           "--model", models, "--concurrency", str(args.concurrency), "--num-requests",
           str(args.num_requests), "--input-len", f"fixed:{args.input_len}", "--output-len",
           f"fixed:{args.output_len}", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_tok_per_s"]


def _ready(root: str) -> bool:
    try:
        return httpx.get(root + "/health/ready").status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", action="store_true", help="start `ember serve` with the adapters")
    p.add_argument("--base-url", default="http://127.0.0.1:8321/v1")
    p.add_argument("--model", default=None, help="the served model (default: SmolLM2)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1,
                   help="rounds of both run first and not counted (a fresh server's first "
                        "steps run its one-time setup)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-lora-bench-"))
    names = [f"a{i}" for i in range(4)]
    proc = None
    if args.start:
        config = open_model_files(args.model).model_config()
        for i, name in enumerate(names):
            write_random_adapter(work / name, config, args.rank, i, std=0.02, alpha=2 * args.rank)
        port = args.base_url.rsplit(":", 1)[1].split("/")[0]
        cmd = [sys.executable, "-m", "ember.cli", "serve", "--port", port, "-q"]
        cmd += ["--model", args.model] if args.model else []
        for name in names:
            cmd += ["--lora", f"{name}={work / name}"]
        proc = subprocess.Popen(cmd)
        root = args.base_url.rsplit("/v1", 1)[0]
        while not _ready(root):
            if proc.poll() is not None:
                raise SystemExit("the server exited")
            time.sleep(0.5)
    base = httpx.get(args.base_url + "/models").json()["data"][0]["id"]
    try:
        for r in range(args.warmup):
            bench(args.base_url, base, args, work / f"warm-base{r}.json")
            bench(args.base_url, ",".join(names), args, work / f"warm-mixed{r}.json")
        results: dict[str, list[float]] = {"base": [], "mixed": []}
        for r in range(args.rounds):
            results["base"].append(bench(args.base_url, base, args, work / f"base{r}.json"))
            results["mixed"].append(bench(args.base_url, ",".join(names), args,
                                          work / f"mixed{r}.json"))
            print(f"round {r}: base {results['base'][-1]:.1f} tok/s, "
                  f"4 adapters mixed {results['mixed'][-1]:.1f} tok/s, ratio "
                  f"{results['mixed'][-1] / results['base'][-1]:.2f}", flush=True)
        base_tps, mixed_tps = (statistics.median(v) for v in results.values())
        paired = statistics.median(m / b for b, m in zip(results["base"], results["mixed"]))
        print(f"median: base {base_tps:.1f} tok/s, mixed {mixed_tps:.1f} tok/s, "
              f"ratio {mixed_tps / base_tps:.2f} (median of the rounds' ratios {paired:.2f})")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
