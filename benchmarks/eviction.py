"""Eviction policies on multi-tenant workloads: where LRU, LFU and cost-aware win or lose.

    .venv/bin/python benchmarks/eviction.py [--out FILE]

Three `ember serve` (one per --eviction-policy) with a KV cache of 100 blocks (1600 tokens),
bf16, each given the identical request sequence at concurrency 1 by `ember bench peers`:

  scan   a popular tenant's 400-token prefix is used in bursts of 4 requests; between bursts
         6 one-off 300-token prompts (113 blocks, more than the cache) pass through. LRU lets
         the scan push the popular prefix out before every burst; LFU and cost keep it.
  shift  tenant X's 400-token prefix is used 8 times, then only tenants Y and Z alternate
         (with one-off prompts between them). LFU keeps X's old hits and evicts the prefixes
         in use now; LRU follows the shift; cost-aware ages X out.

Reported per policy: the share of prompt tokens served from the cache and TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from ember.bench.cli import results_dir
from ember.bench.workloads import PromptMaker, default_corpus, local_tokenizer

BLOCKS, KV_BYTES_PER_BLOCK_BF16 = 100, 23040 * 16  # SmolLM2-135M: 23040 bytes/token in bf16


def build(maker: PromptMaker, kind: str) -> list[dict]:
    def tenant(prefix: str) -> dict:
        return {"prompt": prefix + maker.make(16), "max_tokens": 4}

    def one_off() -> dict:
        return {"prompt": maker.make(300), "max_tokens": 4}

    rows = []
    if kind == "scan":
        popular = maker.make(400)
        for _ in range(5):
            rows += [tenant(popular) for _ in range(4)] + [one_off() for _ in range(6)]
    else:
        x, y, z = maker.make(400), maker.make(400), maker.make(400)
        rows += [tenant(x) for _ in range(8)]
        for _ in range(8):
            rows += [tenant(y), one_off(), tenant(z), one_off()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out_dir = results_dir(os.environ, Path.home())  # never the tree
    parser.add_argument("--out", default=str(out_dir / "eviction"))
    parser.add_argument("--model-file", default=None)
    args = parser.parse_args()
    from ember.weights.loader import default_model_path
    model = args.model_file or str(default_model_path())
    encode, decode = local_tokenizer(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gib = BLOCKS * KV_BYTES_PER_BLOCK_BF16 / 2**30
    serve = f"{sys.executable} -m ember.cli serve --model {{model}} --port {{port}} -q " \
            f"--dtype bfloat16 --kv-cache-gib {gib:.6f}"
    for kind in ("scan", "shift"):
        maker = PromptMaker(default_corpus(), encode, decode, random.Random(7))
        dataset = out / f"{kind}.jsonl"
        dataset.write_text("".join(json.dumps(r) + "\n" for r in build(maker, kind)))
        subprocess.run([
            sys.executable, "-m", "ember.cli", "bench", "peers", "--model-file", model,
            "--ember-args", f"--dtype bfloat16 --kv-cache-gib {gib:.6f} --eviction-policy lru",
            "--peer-cmd", f"lfu={serve} --eviction-policy lfu",
            "--peer-cmd", f"cost={serve} --eviction-policy cost",
            "--workload", "jsonl", "--dataset", str(dataset), "--concurrency", "1",
            "--out", str(out / f"{kind}.json")], check=True, stdout=subprocess.DEVNULL)
        medians = json.loads((out / f"{kind}.json").read_text())["median"]
        print(f"\n{kind}: policy, cached share of prompt tokens, TTFT p50 ms, TTFT mean ms")
        for name, s in medians.items():
            label = "lru" if name == "ember" else name
            share = s["cached_prompt_tokens"] / s["prompt_tokens"]
            print(f"  {label:5} {share * 100:5.1f}%  {s['ttft_s']['p50'] * 1000:7.1f}  "
                  f"{s['ttft_s']['mean'] * 1000:7.1f}")


if __name__ == "__main__":
    main()
