"""Perplexity of a text under the engine, to check that a weight or KV format costs little.

The text runs through the engine like any prompt: scheduled in chunks of the step budget,
its K and V written to (and read back from) the paged cache in whatever format the cache
holds. So with a small `max_num_batched_tokens`, most tokens attend over cached, possibly
quantized, K and V, as they would while serving.

    perplexity = exp(mean over tokens t>0 of -log p(token_t | tokens_<t)), in independent
    windows of `window` tokens (each window starts with an empty context).

llama.cpp's llama-perplexity (-c N) instead scores only the second half of each window (the
tokens at positions N/2 + 1 .. N - 1, each with at least N/2 tokens of context), over whole
windows only, with the first token of each window replaced by BOS where the model adds one:
`scored_from=N // 2 + 1` and `first_token` compute the same figure (`ember perplexity
--like-llama-cpp`).
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from ember.engine.core import EngineCore
from ember.quant.packed import packed_everywhere
from ember.request import RequestOptions, SamplingParams
from ember.scheduler.output import RunnerOutput


def window_nll(core: EngineCore, token_ids: list[int], scored_from: int = 1
               ) -> tuple[float, int]:
    """Sum of -log p over tokens scored_from.. of one window, and how many tokens that is."""
    request_id = "perplexity"
    core.add_request(request_id, token_ids, SamplingParams(temperature=0, max_tokens=1),
                     RequestOptions(prefix_cache=False))
    targets = torch.tensor(token_ids)
    total, count = 0.0, 0
    while core.has_unfinished():
        plan = core.scheduler.schedule()
        inputs, logits = core.runner.forward_all(plan)
        item = plan.scheduled[0]
        logprobs = logits.log_softmax(dim=-1)
        # row j holds position item.start + j and predicts the token at position + 1
        next_positions = torch.arange(item.start + 1, item.end + 1)
        known = (next_positions < len(token_ids)) & (next_positions >= scored_from)
        rows = torch.arange(item.num_new_tokens)[known]
        total -= float(logprobs[rows, targets[next_positions[known]]].sum())
        count += int(known.sum())
        result = RunnerOutput()
        if item.samples:
            result.sampled_token_ids[request_id] = [int(logits[-1].argmax())]
        core.scheduler.update(plan, result)
    return total, count


PATHS = ("decode", "prefill")


def perplexity(core: EngineCore, token_ids: list[int], window: int = 1024,
               path: str = "decode", scored_from: int = 1,
               first_token: int | None = None) -> dict[str, float]:
    """path "decode": the packed (int8/int4) weights score every token, though serving uses
    them only for small batches: the quality of the weight format that decode runs on.
    path "prefill": chunks take the weights prompt chunks take while serving (the dense
    ones, in the engine's prefill_matmul format): the quality of the prompt path.
    scored_from: the first position of each window whose token is scored (1: all but the
    first); first_token: if given, replaces the first token of each window (a BOS)."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}: choose one of {', '.join(PATHS)}")
    if core.has_unfinished():
        raise RuntimeError("perplexity needs an idle engine")
    window = min(window, core.max_model_len - 1)
    if not 1 <= scored_from < window:
        raise ValueError(f"scored_from={scored_from} must be in [1, window={window})")
    total, count = 0.0, 0
    with packed_everywhere(core.runner.model) if path == "decode" else nullcontext():
        for start in range(0, len(token_ids) - 1, window):
            chunk = token_ids[start:start + window]
            if len(chunk) <= scored_from:
                break
            if first_token is not None:
                chunk = [first_token, *chunk[1:]]
            nll, n = window_nll(core, chunk, scored_from)
            total, count = total + nll, count + n
    return {"perplexity": math.exp(total / count), "tokens_scored": count,
            "mean_nll": total / count, "window": window, "scored_from": scored_from,
            "weights": core.quantization, "path": path, "prefill_matmul": core.prefill_matmul}
