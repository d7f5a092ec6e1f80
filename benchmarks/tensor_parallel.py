"""Tensor parallel on the default model: each rank's memory, and single-stream decode speed.

    .venv/bin/python benchmarks/tensor_parallel.py --tp 1 --prefill-matmul bfloat16 memory
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --prefill-matmul bfloat16 memory
    .venv/bin/python benchmarks/tensor_parallel.py --tp 1 speed
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 speed [--all-reduce gloo]
    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --kv-cache-gib 0.5 throughput

memory: the bytes of every tensor each rank's model holds (the packed int4 panels, the dense
copies prompt rows run on, the int8 output projection; rank 1's counted by loading its part
in this process), and each process's resident and peak memory after loading and a short
generation. speed: one request, greedy, 128 tokens; the median step of each of 3 rounds, as
tokens/s, and at T > 1 the time a step spends in the all-reduces called from Python (not those
the decode stack makes itself, in C++, over shared memory) and in the logits gather.
throughput: --requests requests of 128 tokens, --concurrency at once, output tokens/s of
each of 3 rounds.
Prints one JSON line, with the prompt matmuls the engine chose (--prefill-matmul auto: the
same at every T).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

from ember import LLM, SamplingParams
from ember.distributed.collectives import RankCollectives
from ember.engine.tensor_parallel import load_rank_model
from ember.kernels import load_kernels
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


def throughput(llm: LLM, num_requests: int, concurrency: int) -> dict:
    """`num_requests` requests of 128 greedy tokens, at most `concurrency` in the engine at
    once (a finished one replaced at once), after a warm-up at that concurrency: output
    tokens per second of wall time (prompts included), of each of 3 rounds."""
    core = llm.engine
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)

    def prompt(i: int) -> str:
        return llm.chat_prompt([{"role": "user", "content": f"Write story {i} about a dragon."}])

    def run(tag: str, count: int) -> float:
        start, sent, done = time.perf_counter(), 0, 0
        while done < count:
            while sent < count and sent - done < concurrency:
                core.add_request(f"{tag}-{sent}", prompt(sent), params)
                sent += 1
            done += sum(r.is_finished for r in core.step())
        return count * params.max_tokens / (time.perf_counter() - start)
    run("warm", concurrency)
    return {"output_tok_s": [round(run(f"r{i}", num_requests), 1) for i in range(3)],
            "requests": num_requests, "concurrency": concurrency}


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
    parser.add_argument("what", choices=("memory", "speed", "throughput"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prefill-matmul", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=0.05)
    parser.add_argument("--all-reduce", default="auto", choices=("auto", "shm", "gloo"))
    parser.add_argument("--requests", type=int, default=64, help="throughput: requests")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput: at once")
    args = parser.parse_args()
    llm = LLM(tensor_parallel_size=args.tp, prefill_matmul=args.prefill_matmul,
              kv_cache_gib=args.kv_cache_gib, all_reduce=args.all_reduce)
    try:
        if args.what == "memory":
            llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
            result = memory(llm)
        elif args.what == "speed":
            result = speed(llm)
        else:
            result = throughput(llm, args.requests, args.concurrency)
        print(json.dumps({"tp": args.tp, "prefill_matmul": llm.engine.prefill_choice.describe(),
                          args.what: result}))
    finally:
        llm.close()


if __name__ == "__main__":
    main()
