"""HTTP must not slow the engine: the same workload offline and through `ember serve`.

    .venv/bin/python benchmarks/server_overhead.py [--model PATH] [--out FILE]

Workloads (`ember bench offline`'s token-id prompts; greedy, EOS banned):
  single  one streaming request: 32-token prompt, 256 tokens
  batch   32 streaming requests at once: 64-256-token prompts, 64 tokens each
Offline runs LLM.generate in this process; online starts the server in a subprocess on
127.0.0.1 and streams with httpx. The prefix cache is bypassed on both sides, so that repeated
runs recompute what they measure. Output tok/s = generated tokens / wall time; the ratio is
online / offline (1.0 = no overhead). Median of --repeats runs.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ember.bench.cli import results_dir
from ember.bench.offline import offline_workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_tok_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from ember import SamplingParams
    from ember.request import RequestOptions
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, RequestOptions(prefix_cache=False))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "prefix_cache": False}
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage": {' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


def online_tok_s(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    async def main() -> float:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
            start = time.perf_counter()
            counts = await asyncio.gather(*[_stream(c, url, p, max_tokens) for p in prompts])
            return sum(counts) / (time.perf_counter() - start)
    return asyncio.run(main())


def start_server(model: str | None, port: int, dtype: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ember.cli", "serve", "--port", str(port), "-q",
           "--dtype", dtype]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    out_dir = results_dir(os.environ, Path.home())  # never the tree
    parser.add_argument("--out", default=str(out_dir / "server_overhead.json"))
    args = parser.parse_args()

    from ember import LLM
    llm = LLM(args.model, dtype=args.dtype)
    workload = offline_workload(functools.partial(llm.tokenizer.encode, add_special_tokens=False))
    cases = {"single": ([workload["decode"]], 256), "batch": (workload["batch"], 64)}
    results: dict = {"command": " ".join(sys.argv), "dtype": args.dtype}
    offline_tok_s(llm, [workload["decode"]], 4)  # warm-up
    for name, (prompts, n) in cases.items():
        results[name] = {"offline_tok_s": statistics.median(
            offline_tok_s(llm, prompts, n) for _ in range(args.repeats))}
    del llm
    port = free_port()
    proc = start_server(args.model, port, args.dtype)
    try:
        url = f"http://127.0.0.1:{port}"
        online_tok_s(url, [workload["decode"]], 4)  # warm-up
        for name, (prompts, n) in cases.items():
            results[name]["online_tok_s"] = statistics.median(
                online_tok_s(url, prompts, n) for _ in range(args.repeats))
            results[name]["ratio"] = results[name]["online_tok_s"] / results[name]["offline_tok_s"]
    finally:
        proc.terminate()
        proc.wait(30)
    for name in cases:
        r = results[name]
        print(f"{name:7} offline {r['offline_tok_s']:8.1f} tok/s   server {r['online_tok_s']:8.1f}"
              f" tok/s   ratio {r['ratio']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
