"""Offline speed: ember beside llama-cpp-python on the same GGUF, in one run, with ratios.

    .venv/bin/python benchmarks/offline.py --llama-python /path/to/llama-venv/bin/python \
        [--formats float32:none,bfloat16:none,bfloat16:int4] [--repeats 3] \
        [--out FILE]

The workloads are `ember bench offline`'s (ember/bench/offline.py): one stream (32-token
prompt, 256 tokens), one 1024-token prefill, and 32 prompts at once (64 tokens each), as the
same token ids for every engine, greedy, EOS banned. llama-cpp-python's in-process API runs one
sequence at a time, so its batch runs the prompts one after another. This file is also the
peer's worker (`--worker llama_cpp`, run with the peer's own Python: it then imports neither
torch nor ember).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ember.bench.cli import results_dir

DECODE_TOKENS, BATCH_OUTPUT = 256, 64


def run_llama_cpp(model: str, workload: dict, threads: int, repeats: int) -> dict:
    from llama_cpp import Llama
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                n_batch=512, verbose=False)
    ban_eos = {llm.token_eos(): -100.0}

    def generate(prompt: list[int], max_tokens: int, stream: bool):
        llm.reset()
        return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                                     logit_bias=ban_eos, stream=stream)

    for _ in generate(workload["decode"], 8, True):  # warm-up
        pass

    def decode() -> dict:
        start, first = time.perf_counter(), None
        for _ in generate(workload["decode"], DECODE_TOKENS, True):
            first = first or time.perf_counter()
        end = time.perf_counter()  # the last chunk carries only finish_reason
        return {"ttft_s": first - start, "decode_tok_per_s": (DECODE_TOKENS - 1) / (end - first)}

    def prefill() -> float:
        start = time.perf_counter()
        generate(workload["prefill"], 1, False)
        return time.perf_counter() - start

    def batch() -> float:
        start = time.perf_counter()
        n = sum(generate(p, BATCH_OUTPUT, False)["usage"]["completion_tokens"]
                for p in workload["batch"])
        return n / (time.perf_counter() - start)

    return {"decodes": [decode() for _ in range(repeats)],
            "prefills": [prefill() for _ in range(repeats)],
            "batches": [batch() for _ in range(repeats)]}


def run_peer(python: str, model: str, workload: dict, threads: int, repeats: int) -> dict:
    from ember.bench.offline import summarize_offline
    job = json.dumps({"model": model, "workload": workload, "threads": threads,
                      "repeats": repeats})
    done = subprocess.run([python, __file__, "--worker", "llama_cpp"], input=job, text=True,
                          capture_output=True, check=False)
    if done.returncode:
        raise SystemExit(f"llama-cpp-python worker failed:\n{done.stderr[-2000:]}")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return summarize_offline(raw["decodes"], raw["prefills"], raw["batches"],
                             workload) | {"engine": "llama-cpp-python Q4_1"}


ROWS = [("decode tok/s (1 stream, 256 tokens)", "decode_tok_per_s"),
        ("TTFT s, 32-token prompt", "short_prompt_ttft_s"),
        ("TTFT s, 1024-token prompt", "prefill_ttft_s"),
        ("prefill tok/s (1024 tokens)", "prefill_tok_per_s"),
        ("batch output tok/s (32 prompts)", "batch_output_tok_per_s")]


def report(results: dict) -> None:
    peer = results.get("llama_cpp")
    names = [k for k in results if k.startswith("ember_")]
    print(f"{'metric':38}" + "".join(f"{n:>18}" for n in names) + f"{'llama-cpp':>12}")
    for label, key in ROWS:
        theirs = peer[key] if peer else float("nan")
        cells = "".join(f"{results[n][key]:>10.3f} ({results[n][key] / theirs:4.2f}x)"
                        for n in names)
        print(f"{label:38}{cells}{theirs:>12.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--llama-python", default=None,
                        help="python of a venv with llama-cpp-python (omit to run ember alone)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default="float32:none,bfloat16:none,bfloat16:int4",
                        help="ember DTYPE:QUANTIZATION pairs to run, comma-separated")
    out_dir = results_dir(os.environ, Path.home())  # never the tree
    parser.add_argument("--out", default=str(out_dir / "offline.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "llama_cpp":
        job = json.loads(sys.stdin.read())
        print(json.dumps(run_llama_cpp(job["model"], job["workload"], job["threads"],
                                       job["repeats"])))
        return

    import torch

    from ember import LLM
    from ember.bench.offline import offline_workload, run_offline
    torch.set_num_threads(args.threads)
    results: dict = {"command": " ".join(sys.argv)}
    workload = None
    for spec in args.formats.split(","):
        dtype, _, quantization = spec.partition(":")
        llm = LLM(args.model, dtype=dtype, quantization=quantization or "auto")
        results["model"] = str(llm.engine.model_path)
        workload = workload or offline_workload(
            functools.partial(llm.tokenizer.encode, add_special_tokens=False))
        results[f"ember_{dtype}_{llm.engine.quantization}"] = run_offline(llm, workload,
                                                                          args.repeats)
        del llm
    if args.llama_python:
        results["llama_cpp"] = run_peer(args.llama_python, results["model"], workload,
                                        args.threads, args.repeats)
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
