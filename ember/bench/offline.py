"""`ember bench offline`: the engine in-process, no HTTP. The one bench module that imports
the engine; everything else in ember.bench speaks HTTP to any server.

  decode   one stream: 32-token prompt, 256 greedy tokens; tok/s after the first token
  prefill  one 1024-token prompt, 1 token: time to first token (prefill tok/s = 1024 / TTFT)
  batch    N prompts (64-256 tokens) at once, 64 tokens each: output tok/s over the wall time
EOS is banned everywhere, so every engine makes exactly the tokens asked for.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from ember.bench.workloads import default_corpus

DECODE_TOKENS, PREFILL_TOKENS, BATCH_OUTPUT = 256, 1024, 64


def offline_workload(encode: Callable[[str], list[int]], batch_size: int = 32, seed: int = 0,
                     corpus: str | None = None, max_len: int = 1 << 30) -> dict[str, Any]:
    """Token-id prompts (so every engine sees the same tokens), cut from the corpus; the
    prefill prompt is shortened only for a model whose context holds fewer than 1024 + 1."""
    ids = encode(corpus or default_corpus())
    rng = random.Random(seed)

    def window(n: int) -> list[int]:
        start = rng.randrange(0, len(ids) - n)
        return ids[start:start + n]
    return {"decode": window(32), "prefill": window(min(PREFILL_TOKENS, max_len - 1)),
            "batch": [window(rng.randint(64, 256)) for _ in range(batch_size)]}


def run_offline(llm, workload: dict[str, Any], repeats: int = 3) -> dict[str, Any]:
    """The prefix cache is bypassed: repeats must recompute what they measure."""
    from ember import SamplingParams
    from ember.request import RequestOptions
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    cold = RequestOptions(prefix_cache=False)
    llm.generate([workload["decode"]], greedy(4), cold)  # warm-up

    def decode() -> dict[str, float]:
        start, first = time.perf_counter(), None
        for _ in llm.stream(workload["decode"], greedy(DECODE_TOKENS), cold):
            first = first or time.perf_counter()
        end = time.perf_counter()
        return {"ttft_s": first - start, "decode_tok_per_s": (DECODE_TOKENS - 1) / (end - first)}

    def prefill() -> float:
        start = time.perf_counter()
        llm.generate([workload["prefill"]], greedy(1), cold)
        return time.perf_counter() - start

    def batch() -> float:
        start = time.perf_counter()
        outs = llm.generate(workload["batch"], greedy(BATCH_OUTPUT), cold)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    return summarize_offline([decode() for _ in range(repeats)],
                             [prefill() for _ in range(repeats)],
                             [batch() for _ in range(repeats)], workload) | {
        "engine": f"ember {str(llm.engine.dtype).removeprefix('torch.')}",
        "kv_cache_dtype": llm.engine.cache_info.dtype, "weights": llm.engine.quantization}


def summarize_offline(decodes: list[dict[str, float]], prefills: list[float],
                      batches: list[float], workload: dict[str, Any]) -> dict[str, Any]:
    """Medians of the repeated runs (shared with the peer runner in benchmarks/offline.py)."""
    ttft = statistics.median(prefills)
    return {"decode_tok_per_s": statistics.median(d["decode_tok_per_s"] for d in decodes),
            "short_prompt_ttft_s": statistics.median(d["ttft_s"] for d in decodes),
            "prefill_tokens": len(workload["prefill"]), "prefill_ttft_s": ttft,
            "prefill_tok_per_s": len(workload["prefill"]) / ttft,
            "batch_output_tok_per_s": statistics.median(batches),
            "batch_size": len(workload["batch"]), "repeats": len(prefills)}
