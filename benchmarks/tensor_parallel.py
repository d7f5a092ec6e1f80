"""Tensor parallel on the default model: each rank's memory, and single-stream decode speed.

    .venv/bin/python benchmarks/tensor_parallel.py --tp 1 --prefill-matmul bfloat16 memory
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --prefill-matmul bfloat16 memory
    .venv/bin/python benchmarks/tensor_parallel.py --tp 1 speed
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 speed [--all-reduce gloo]
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --kv-cache-gib 0.5 throughput
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --kv-head-split groups speed
    .venv/bin/python benchmarks/tensor_parallel.py --kv-cache-gib 0.5 --rounds 6 paired
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --kv-cache-gib 0.5 prompt
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --kv-cache-gib 0.5 phases

memory: the bytes of every tensor each rank's model holds (the packed int4 panels, the dense
copies prompt rows run on, the int8 output projection; rank 1's counted by loading its part
in this process), and each process's resident and peak memory after loading and a short
generation. speed: one request, greedy, 128 tokens; the median step of each of 3 rounds, as
tokens/s, and at T > 1 the time a step spends in the all-reduces called from Python (not those
the decode stack makes itself, in C++, over shared memory) and in the logits gather.
throughput: --requests requests of --max-tokens tokens (128), --concurrency at once, output
tokens/s of each of 3 rounds. prompt: a 1,024-token prompt's time to its first token.
phases: --concurrency requests decoding together, 250 steps; of the steps of that many rows,
the driver's median time in the embedding (at T > 1 with its all-reduce, where rank 0 waits
for the others to start the step), the layers, the output projection (with the logits'
gather or, for plain greedy rows, the ranks' best tokens) and the rest of the step
(sampling, scheduling, the next step's inputs and plan).
paired: T=1, T=2 with whole GQA groups and T=2 with the shared KV head (--kv-head-split),
each loaded once in its own process, one stream and a throughput run of each in turn,
--rounds times, with each T=2 layout's ratio to T=1 round by round.
Prints one JSON line, with the prompt matmuls the engine chose (--prefill-matmul auto: the
same at every T).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter

import torch

from ember import LLM, SamplingParams
from ember.request import RequestOptions
from ember.distributed.collectives import RankCollectives
from ember.engine.tensor_parallel import load_rank_model
from ember.kernels import cpu_flags, load_kernels
from ember.weights.loader import open_model_files

MIB = 1 << 20


def tensor_bytes(model: torch.nn.Module) -> int:
    """Every tensor a module tree holds (parameters, buffers and plain tensor attributes such
    as PackedLinear's dense weight), each storage once."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            if t.layout == torch._mkldnn:   # oneDNN's blocked copy: no storage to share
                total += t.numel() * t.element_size()
                continue
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def process_memory(pid: int | str = "self") -> dict[str, float]:
    """Resident (VmRSS) and peak resident (VmHWM) MiB of a process."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def memory(llm: LLM) -> dict:
    core = llm.engine
    result = {"rank0_weights_mib": round(tensor_bytes(core.runner.model) / MIB, 1),
              "rank0": process_memory(), "kv": core.cache_info.describe()}
    executor = core.executor
    for rank, worker in enumerate(getattr(executor, "workers", []), start=1):
        result[f"rank{rank}"] = process_memory(worker.pid)
        setup = core.rank_setup   # what the engine gave its workers to build from
        files = open_model_files(core.config.model)
        model = load_rank_model(files, files.model_config(), setup, rank,
                                load_kernels(core.config.kernels, core.config.device),
                                RankCollectives())
        result[f"rank{rank}_weights_mib"] = round(tensor_bytes(model) / MIB, 1)
    return result


def speed(llm: LLM) -> dict:
    waits: Counter[str] = Counter()
    collectives = getattr(llm.engine.executor, "collectives", None)
    if collectives is not None:
        timed(collectives, "_all_reduce", waits)
        timed(collectives, "_gather", waits)
    prompt = llm.chat_prompt([{"role": "user", "content": "Write a story about a dragon."}])
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
    rates, steps_total = [], 0
    waits.clear()
    for i in range(3):
        core = llm.engine
        core.add_request(f"r{i}", prompt, params)
        steps = []
        while core.has_unfinished():
            start = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - start)
        rates.append(round(1 / statistics.median(steps[1:]), 1))
        steps_total += len(steps)
    result = {"tok_s_median_step": rates, "threads_rank0": torch.get_num_threads()}
    if collectives is not None:
        result["ms_per_step"] = {k: round(v / steps_total * 1e3, 2) for k, v in waits.items()
                                 if not k.startswith("n_")}
        result["all_reduces_per_step"] = round(waits["n__all_reduce"] / steps_total, 1)
    return result


def run_requests(llm: LLM, tag: str, count: int, concurrency: int, max_tokens: int) -> float:
    """`count` requests of `max_tokens` greedy tokens, at most `concurrency` in the engine at
    once (a finished one replaced at once): output tokens per second of wall time (prompts
    included)."""
    core = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, sent, done = time.perf_counter(), 0, 0
    while done < count:
        while sent < count and sent - done < concurrency:
            prompt = llm.chat_prompt([{"role": "user",
                                       "content": f"Write story {sent} about a dragon."}])
            core.add_request(f"{tag}-{sent}", prompt, params)
            sent += 1
        done += sum(r.is_finished for r in core.step())
    return count * max_tokens / (time.perf_counter() - start)


def throughput(llm: LLM, num_requests: int, concurrency: int, max_tokens: int = 128) -> dict:
    """run_requests after a warm-up at that concurrency, 3 rounds."""
    run_requests(llm, "warm", concurrency, concurrency, max_tokens)
    return {"output_tok_s": [round(run_requests(llm, f"r{i}", num_requests, concurrency,
                                                max_tokens), 1) for i in range(3)],
            "requests": num_requests, "concurrency": concurrency, "max_tokens": max_tokens}


def one_stream(llm: LLM, tag: str) -> float:
    """One request of 128 greedy tokens: 1 / its median decode step, tokens/s."""
    core = llm.engine
    prompt = llm.chat_prompt([{"role": "user", "content": "Write a story about a dragon."}])
    core.add_request(tag, prompt, SamplingParams(max_tokens=128, temperature=0,
                                                 ignore_eos=True))
    steps = []
    while core.has_unfinished():
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    return 1 / statistics.median(steps[1:])


def long_prompt(llm: LLM) -> dict:
    """One prompt of 1,024 seeded random tokens at a time, the prefix cache off, one output
    token: the median time to it of 5, after one to warm up, ms."""
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(1030)]
    times = []
    for i in range(6):
        start = time.perf_counter()
        llm.generate([ids[i:i + 1024]], SamplingParams(max_tokens=1, temperature=0),
                     RequestOptions(prefix_cache=False))
        times.append(time.perf_counter() - start)
    return {"ttft_ms_median": round(statistics.median(times[1:]) * 1e3, 1)}


def phases(llm: LLM, concurrency: int) -> dict:
    """`concurrency` greedy requests decoding together: the driver's median milliseconds
    per phase over the steps of that many rows (the first and last left out)."""
    core, model = llm.engine, llm.engine.runner.model
    marks: dict[str, float] = {}

    def timed_call(name: str, inner):
        def call(*args, **kwargs):
            marks[name + "0"] = time.perf_counter()
            out = inner(*args, **kwargs)
            marks[name + "1"] = time.perf_counter()
            return out
        return call
    embed = model.model.embed_tokens
    embed.forward = timed_call("embed", embed.forward)
    model.forward = timed_call("model", model.forward)
    model.compute_logits = timed_call("head", model.compute_logits)
    model.compute_argmax = timed_call("head", model.compute_argmax)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        core.add_request(f"p{i}", llm.chat_prompt([{"role": "user", "content":
                                                     f"Write story {i} about a dragon."}]),
                         params)
    steps = []
    for _ in range(250):
        marks.clear()
        start = time.perf_counter()
        core.step()
        end = time.perf_counter()
        if "head1" in marks:   # a step that sampled
            steps.append((dict(marks), start, end))

    def median_ms(phase) -> float:
        return round(statistics.median(phase(m, s, e) for m, s, e in steps[1:-1]) * 1e3, 3)
    return {"steps": len(steps) - 2, "concurrency": concurrency,
            "step_ms": median_ms(lambda m, s, e: e - s),
            "embedding_ms": median_ms(lambda m, s, e: m["embed1"] - m["embed0"]),
            "layers_ms": median_ms(lambda m, s, e: m["model1"] - m["embed1"]),
            "output_projection_ms": median_ms(lambda m, s, e: m["head1"] - m["head0"]),
            "rest_ms": median_ms(lambda m, s, e: (e - s) - (m["head1"] - m["head0"])
                                 - (m["model1"] - m["model0"]))}


# paired: each layout loaded once, in a process of its own that waits for orders on stdin
LAYOUTS = {"T=1": ["--tp", "1"],
           "T=2 groups": ["--tp", "2", "--all-reduce", "shm", "--kv-head-split", "groups"],
           "T=2 shared": ["--tp", "2", "--all-reduce", "shm", "--kv-head-split", "shared"]}


def serve_orders(llm: LLM, args: argparse.Namespace) -> None:
    """A paired child: warm up, say so, then answer each stdin line ("speed": one_stream,
    "throughput": one run_requests) with its figure, one line each."""
    one_stream(llm, "warm-1")
    run_requests(llm, "warm-c", args.concurrency, args.concurrency, args.max_tokens)
    print("ready", flush=True)
    for i, line in enumerate(sys.stdin):
        what = line.strip()
        value = one_stream(llm, f"s{i}") if what == "speed" else \
            run_requests(llm, f"c{i}", args.requests, args.concurrency, args.max_tokens)
        print(round(value, 1), flush=True)


def paired(args: argparse.Namespace) -> dict:
    """T=1, T=2 with whole groups and T=2 with the shared KV head, each loaded once in its
    own process (the others idle meanwhile: their ranks sleep), run in turn, the order
    rotating every round: single-stream and concurrency figures of each, and each T=2
    layout's per-round ratio to T=1 (the machine's drift between rounds cancels)."""
    children = {}
    for name, layout in LAYOUTS.items():
        child = subprocess.Popen(
            [sys.executable, __file__, "_serve", *layout, "--kv-cache-gib", str(args.kv_cache_gib),
             "--requests", str(args.requests), "--concurrency", str(args.concurrency),
             "--max-tokens", str(args.max_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"{name}: the engine did not start")
        children[name] = child
    figures = {what: {name: [] for name in LAYOUTS} for what in ("speed", "throughput")}
    names = list(LAYOUTS)
    try:
        for r in range(args.rounds):
            for what in figures:
                for name in names[r % 3:] + names[:r % 3]:
                    children[name].stdin.write(what + "\n")
                    children[name].stdin.flush()
                    figures[what][name].append(float(children[name].stdout.readline()))
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=120)
    ratios = {what: {name: [round(a / b, 3) for a, b in zip(values[name], values["T=1"])]
                     for name in names[1:]} for what, values in figures.items()}
    return {"figures": figures, "ratio_to_t1": ratios,
            "median_ratio": {what: {name: statistics.median(r) for name, r in by.items()}
                             for what, by in ratios.items()}}


def timed(collectives: RankCollectives, name: str, waits: Counter) -> None:
    """Wrap one of rank 0's bound collectives to add up the time spent in it."""
    inner = getattr(collectives, name)

    def wrapper(x):
        start = time.perf_counter()
        out = inner(x)
        waits[name] += time.perf_counter() - start
        waits["n_" + name] += 1
        return out
    setattr(collectives, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("memory", "speed", "throughput", "prompt", "paired",
                                         "phases", "_serve"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prefill-matmul", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=0.05)
    parser.add_argument("--all-reduce", default="auto", choices=("auto", "shm", "gloo"))
    parser.add_argument("--kv-head-split", default="shared", choices=("shared", "groups"))
    parser.add_argument("--requests", type=int, default=64, help="throughput: requests")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput: at once")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="throughput: output tokens a request")
    parser.add_argument("--rounds", type=int, default=6, help="paired: rounds")
    args = parser.parse_args()
    if args.what == "paired":
        flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
        print(json.dumps({"paired": paired(args), "cpu_flags": flags,
                          "kv_cache_gib": args.kv_cache_gib}))
        return
    llm = LLM(tensor_parallel_size=args.tp, prefill_matmul=args.prefill_matmul,
              kv_cache_gib=args.kv_cache_gib, all_reduce=args.all_reduce,
              kv_head_split=args.kv_head_split)
    try:
        if args.what == "_serve":
            serve_orders(llm, args)
            return
        if args.what == "memory":
            llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
            result = memory(llm)
        elif args.what == "speed":
            result = speed(llm)
        elif args.what == "prompt":
            result = long_prompt(llm)
        elif args.what == "phases":
            result = phases(llm, args.concurrency)
        else:
            result = throughput(llm, args.requests, args.concurrency, args.max_tokens)
        print(json.dumps({"tp": args.tp, "kv_head_split": args.kv_head_split,
                          "prefill_matmul": llm.engine.prefill_choice.describe(),
                          args.what: result}))
    finally:
        llm.close()


if __name__ == "__main__":
    main()
