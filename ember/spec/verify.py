"""Verification: which drafted tokens the target model keeps.

A request with drafts d_0 .. d_{k-1} had k+1 rows of logits computed in the step:

    row:       0          1          ...   k
    after:     newest     d_0        ...   d_{k-1}
    checks:    d_0        d_1        ...   (bonus)

Greedy: keep d_j while it equals row j's argmax; the first row where it does not (row k when
all are kept) gives the model's own token, so the output is greedy decoding's, token for token.

Random (temperature > 0): rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with a
proposer that drafts deterministically (q puts all its mass on d_j): keep d_j with probability
p_j(d_j); at the first rejection draw from the residual max(p_j - q_j, 0), which is p_j
without d_j; when all k are kept draw the bonus token from p_k. Every emitted token then has the
law of sampling p directly. p_j is the distribution the sampler would sample at that position
(penalties, bias, temperature, top-k/p, min-p), with the drafts before it counted as output.

A seeded request instead draws at each row what the sampler would draw there without
speculation (its noise is a function of the seed and the position: Sampler.noise) and keeps
d_j while that draw is d_j: d_j is kept with probability p_j(d_j) as above, and the tokens
are those of the same request run without speculation, token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ember.request import Request, SampledLogprob, SamplingParams
from ember.sampling.sampler import (Sampler, argmax_alone, _rows, build_sampling_batch,
                                    process_logits, sampling_probs)


@dataclass(frozen=True)
class _DraftRow:
    """A request as seen at a verified position: the drafts before it counted as output."""

    request_id: str
    params: SamplingParams
    eos_token_ids: frozenset[int]
    output_token_ids: list[int]
    all_token_ids: list[int]
    grammar: None = None


def draft_rows(request: Request, drafts: tuple[int, ...]) -> list:
    """One view per verified row: the request itself, then it after each draft."""
    rows: list = [request]
    for j in range(1, len(drafts) + 1):
        rows.append(_DraftRow(request.request_id, request.params, request.eos_token_ids,
                              request.output_token_ids + list(drafts[:j]),
                              request.all_token_ids + list(drafts[:j])))
    return rows


def verify(sampler: Sampler, logits: Tensor, requests: list[Request],
           drafts: list[tuple[int, ...]]
           ) -> tuple[list[list[int]], list[list[SampledLogprob] | None]]:
    """logits [sum(1 + len(d)), V] float32, each request's rows in turn -> the tokens each
    request emits (its accepted drafts, then one of the target's) and their logprobs."""
    rows = [view for r, d in zip(requests, drafts) for view in draft_rows(r, d)]
    probs, targets, row_of = None, None, {}
    num_logprobs = None
    if all(argmax_alone(r) for r in requests):
        targets = sampler._argmax(logits).tolist()
    else:
        batch = build_sampling_batch(rows, logits.shape[-1], logits.device)
        num_logprobs = batch.num_logprobs
        processed = process_logits(logits, batch, in_place=num_logprobs is None)
        targets = sampler._argmax(processed).tolist()
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            probs = sampling_probs(processed[random_rows], _rows(batch, random_rows))
            row_of = {row: n for n, row in enumerate(random_rows)}
    tokens: list[list[int]] = []
    first = 0
    for request, d in zip(requests, drafts):
        if request.params.greedy:
            tokens.append(greedy_walk(d, targets[first:first + len(d) + 1]))
        else:
            rows_probs = probs[[row_of[first + j] for j in range(len(d) + 1)]]
            tokens.append(seeded_walk(sampler, request, d, rows_probs)
                          if request.params.seed is not None else
                          rejection_walk(d, rows_probs, sampler.generator))
        first += len(d) + 1
    return tokens, _logprobs(logits, rows, requests, drafts, tokens, num_logprobs)


def greedy_walk(drafts: tuple[int, ...], targets: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's argmax, then that argmax."""
    for j, token in enumerate(drafts):
        if token != targets[j]:
            return list(drafts[:j]) + [targets[j]]
    return list(drafts) + [targets[len(drafts)]]


def seeded_walk(sampler: Sampler, request: Request, drafts: tuple[int, ...],
                probs: Tensor) -> list[int]:
    """probs [k+1, V]: the sampling distribution at each row. Row j's draw is the sampler's
    at that position (Sampler.noise); keep d_j while it is d_j, else end with the draw."""
    noise = torch.empty_like(probs)
    position = len(request.all_token_ids)
    for j in range(len(drafts) + 1):
        sampler.noise(noise[j], request, position + j)
    draws = sampler._argmax(probs / noise).tolist()
    return greedy_walk(drafts, draws)


def rejection_walk(drafts: tuple[int, ...], probs: Tensor,
                   generator: torch.Generator) -> list[int]:
    """probs [k+1, V]: the sampling distribution at each row. Keep d_j with probability
    p_j(d_j); at the first rejection draw from p_j without d_j; else the bonus from p_k."""
    uniforms = torch.rand(len(drafts), generator=generator,
                          device=probs.device).tolist() if drafts else []
    for j, token in enumerate(drafts):
        if uniforms[j] < probs[j, token].item():
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        return list(drafts[:j]) + [_draw(residual, generator)]
    return list(drafts) + [_draw(probs[len(drafts)], generator)]


def _draw(weights: Tensor, generator: torch.Generator) -> int:
    """A token with probability proportional to `weights` [V] (the exponential race, as the
    sampler draws: no normalisation needed)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())


def _logprobs(logits: Tensor, rows: list, requests: list[Request],
              drafts: list[tuple[int, ...]], tokens: list[list[int]],
              num_logprobs: int | None) -> list[list[SampledLogprob] | None]:
    """Each emitted token's logprobs, from the row that chose it (a rejected draft's row
    gives the token drawn there instead; rows after it are never reported)."""
    if num_logprobs is None:
        return [None] * len(requests)
    index, views, chosen = [], [], []
    first = 0
    for d, emitted in zip(drafts, tokens):
        index += range(first, first + len(emitted))
        views += rows[first:first + len(emitted)]
        chosen += emitted
        first += len(d) + 1
    flat = Sampler._logprobs(logits[index], torch.tensor(chosen, device=logits.device), views,
                             num_logprobs)
    out: list[list[SampledLogprob] | None] = []
    first = 0
    for emitted in tokens:
        part = flat[first:first + len(emitted)]
        out.append(None if part and part[0] is None else part)
        first += len(emitted)
    return out
