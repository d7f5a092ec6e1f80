"""Offline speed: ember beside llama-cpp-python on the same GGUF, in one run, with ratios.

    .venv/bin/python benchmarks/offline.py --llama-python /path/to/llama-venv/bin/python
        [--dtypes float32,bfloat16] [--repeats 3] [--out results/offline.json]

Workloads (token ids built once, from tiny Shakespeare, and given to both engines):
  single  one stream: a 32-token prompt, 256 greedy tokens (EOS banned); decode tok/s counts
          the tokens after the first over the time after the first.
  batch   32 prompts of 64-256 tokens, 64 greedy tokens each; output tok/s over the wall time.
          ember batches them (continuous batching); llama-cpp-python's in-process API runs one
          sequence at a time, so it runs them one after another.
Each figure is the median of --repeats runs. Results go to --out as JSON. This file is also the
peer's worker (`--worker llama_cpp`), run with the peer's own Python: it then imports neither
torch nor ember.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def make_workload(encode, text: str, seed: int = 0) -> dict:
    ids = encode(text[:400_000])
    rng = random.Random(seed)

    def take(n: int) -> list[int]:
        start = rng.randrange(0, len(ids) - n)
        return ids[start:start + n]

    return {"single": {"prompt": take(32), "max_tokens": 256},
            "batch": {"prompts": [take(rng.randint(64, 256)) for _ in range(32)],
                      "max_tokens": 64}}


def summarize(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"runs": runs}


# -- ember ------------------------------------------------------------------------------------

def run_ember(model: str | None, workload: dict, threads: int, repeats: int, dtype: str) -> dict:
    import torch

    from ember import LLM, SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype)
    single, batch = workload["single"], workload["batch"]
    llm.generate([single["prompt"]], SamplingParams(temperature=0, max_tokens=8))  # warm-up

    def one_stream() -> dict:
        params = SamplingParams(temperature=0, max_tokens=single["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        first = None
        for _ in llm.stream(single["prompt"], params):
            first = first or time.perf_counter()
        end = time.perf_counter()
        n = single["max_tokens"]
        return {"ttft_s": first - start, "decode_tok_s": (n - 1) / (end - first)}

    def many() -> dict:
        params = SamplingParams(temperature=0, max_tokens=batch["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(batch["prompts"], params)
        wall = time.perf_counter() - start
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"batch_output_tok_s": n / wall, "batch_wall_s": wall}

    return {"single": summarize([one_stream() for _ in range(repeats)]),
            "batch": summarize([many() for _ in range(repeats)]),
            "engine": f"ember {dtype}", "threads": threads}


# -- llama-cpp-python (runs in its own venv) ---------------------------------------------------

def run_llama_cpp(model: str, workload: dict, threads: int, repeats: int) -> dict:
    from llama_cpp import Llama
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                n_batch=512, verbose=False)
    ban_eos = {llm.token_eos(): -100.0}
    single, batch = workload["single"], workload["batch"]

    def generate(prompt: list[int], max_tokens: int, stream: bool):
        llm.reset()
        return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                                     logit_bias=ban_eos, stream=stream)

    for _ in generate(single["prompt"], 8, True):  # warm-up
        pass

    def one_stream() -> dict:
        start = time.perf_counter()
        first = None
        for _ in generate(single["prompt"], single["max_tokens"], True):
            first = first or time.perf_counter()
        end = time.perf_counter()
        n = single["max_tokens"]  # EOS is banned; the last chunk only carries finish_reason
        return {"ttft_s": first - start, "decode_tok_s": (n - 1) / (end - first)}

    def many() -> dict:
        start = time.perf_counter()
        n = sum(generate(p, batch["max_tokens"], False)["usage"]["completion_tokens"]
                for p in batch["prompts"])
        wall = time.perf_counter() - start
        return {"batch_output_tok_s": n / wall, "batch_wall_s": wall}

    return {"single": summarize([one_stream() for _ in range(repeats)]),
            "batch": summarize([many() for _ in range(repeats)]),
            "engine": "llama-cpp-python", "threads": threads}


def run_peer(python: str, model: str, workload: dict, threads: int, repeats: int) -> dict:
    job = json.dumps({"model": model, "workload": workload, "threads": threads,
                      "repeats": repeats})
    done = subprocess.run([python, __file__, "--worker", "llama_cpp"], input=job, text=True,
                          capture_output=True, check=False)
    if done.returncode:
        raise SystemExit(f"llama-cpp-python worker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--llama-python", default=None,
                        help="python of a venv with llama-cpp-python (omit to run ember alone)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="ember weight dtypes to run, comma-separated")
    parser.add_argument("--out", default="results/offline.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "llama_cpp":
        job = json.loads(sys.stdin.read())
        print(json.dumps(run_llama_cpp(job["model"], job["workload"], job["threads"],
                                       job["repeats"])))
        return

    from ember.tokenizer.tokenizer import Tokenizer
    from ember.weights.loader import open_model_files
    files = open_model_files(args.model)
    tokenizer = Tokenizer.from_gguf_metadata(files.metadata)
    workload = make_workload(lambda t: tokenizer.encode(t, add_special_tokens=False),
                             SHAKESPEARE.read_text())
    results = {"model": str(files.path), "command": " ".join(sys.argv)}
    for dtype in args.dtypes.split(","):
        results[f"ember_{dtype}"] = run_ember(str(files.path), workload, args.threads,
                                              args.repeats, dtype)
    if args.llama_python:
        results["llama_cpp"] = run_peer(args.llama_python, str(files.path), workload,
                                        args.threads, args.repeats)
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def report(results: dict) -> None:
    """One row per metric and ember dtype, with the ratio to llama-cpp-python."""
    rows = [("single-stream decode tok/s", "single", "decode_tok_s"),
            ("single-stream TTFT s (32-token prompt)", "single", "ttft_s"),
            ("32-prompt batch output tok/s", "batch", "batch_output_tok_s")]
    peer = results.get("llama_cpp")
    embers = [k for k in results if k.startswith("ember_")]
    print(f"{'metric':40} {'engine':16} {'ember':>9} {'llama-cpp':>10} {'ratio':>7}")
    for label, group, key in rows:
        theirs = peer[group][key] if peer else float("nan")
        for name in embers:
            mine = results[name][group][key]
            print(f"{label:40} {name:16} {mine:9.3f} {theirs:10.3f} {mine / theirs:7.2f}")


if __name__ == "__main__":
    main()
