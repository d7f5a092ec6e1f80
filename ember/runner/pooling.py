"""Embedding requests' hidden states -> one L2-normalised vector each.

An embedding request is a prompt that the scheduler prefills like any other (in chunks, under
the step's token budget, beside generation) and that ends with its last chunk, without a token
sampled. Its rows of the step's final hidden states are pooled here:

    last   the prompt's last token (decoders: the only one that has seen the whole prompt)
    mean   the average over all the prompt's tokens (sentence-transformers' default)
    cls    the prompt's first token (BERT's [CLS])

A mean over a chunked prompt is summed chunk by chunk. Each chunk's sum is kept under the
chunk's start, so a chunk computed again (a step retried after a failure, a preempted
request recomputed from position 0) replaces its earlier sum instead of adding to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.scheduler.output import ScheduledRequest, SchedulerOutput


class Pooler:
    def __init__(self) -> None:
        # request id -> {chunk start: (tokens, their summed hidden states [hidden] float32)}
        self._partial: dict[str, dict[int, tuple[int, Tensor]]] = {}

    def forget(self, request_ids: frozenset[str]) -> None:
        """Drop the partial sums of requests that finished or were aborted."""
        for request_id in request_ids:
            self._partial.pop(request_id, None)

    def pool(self, plan: SchedulerOutput, hidden: Tensor) -> dict[str, list[float]]:
        """hidden [T, hidden], rows in the plan's order -> the vectors of the embedding
        requests whose last chunk ran in this step."""
        vectors: dict[str, list[float]] = {}
        row = 0
        for item in plan.scheduled:
            if item.request.pooling is not None:
                vector = self._take(item, hidden[row:row + item.num_new_tokens])
                if vector is not None:
                    vectors[item.request.request_id] = vector
            row += item.num_new_tokens
        return vectors

    def _take(self, item: ScheduledRequest, rows: Tensor) -> list[float] | None:
        """One request's rows of this step [n, hidden]; its vector if the prompt is done."""
        request = item.request
        method = request.pooling.method
        chunks = self._partial.setdefault(request.request_id, {})
        for start in [s for s in chunks if s >= item.start]:  # computed again
            del chunks[start]
        if method == "mean":
            chunks[item.start] = (item.num_new_tokens, rows.float().sum(dim=0))
        elif method == "cls" and item.start == 0:
            chunks[0] = (1, rows[0].float())
        if item.end < request.num_prompt_tokens:
            return None
        del self._partial[request.request_id]
        if method == "last":
            pooled = rows[-1].float()
        else:
            pooled = sum(s for _, s in chunks.values()) / sum(n for n, _ in chunks.values())
        return finish_vector(pooled, request.pooling.dimensions)


def finish_vector(pooled: Tensor, dimensions: int | None) -> list[float]:
    """pooled [hidden] float32 -> its first `dimensions` values (all if None), L2-normalised,
    as a list (Matryoshka truncation: the norm is taken after cutting)."""
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return F.normalize(pooled, dim=0).tolist()


def pool_padded(hidden: Tensor, lengths: Tensor, method: str) -> Tensor:
    """hidden [B, L, hidden] of right-padded prompts with `lengths` [B] -> [B, hidden]
    float32 (an encoder's whole batch at once)."""
    hidden = hidden.float()
    if method == "cls":
        return hidden[:, 0]
    if method == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    mask = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
    return (hidden * mask[..., None]).sum(dim=1) / lengths[:, None].to(hidden.dtype)
