"""SchedulerOutput -> flat tensors for one forward pass. All the index maths lives here.

The step's tokens are laid out in one flat batch, decodes first:

    request:   d0  d1  d2 | p0 p0 p0 p0 | p1 p1 p1
    row:        0   1   2 |  3  4  5  6 |  7  8  9

A request's new token at position `pos` goes to cache slot
`block_ids[pos // block_size] * block_size + pos % block_size`. The logits rows are the last new
token of each request that samples (a leading prefill chunk samples nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ember.kv.kv_manager import cdiv
from ember.models.attention import AttentionMetadata, PrefillChunk
from ember.request import Request
from ember.scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class ModelInputs:
    input_ids: Tensor        # [T] long
    positions: Tensor        # [T] long
    attn: AttentionMetadata
    logits_indices: Tensor   # [S] long: rows whose next-token distribution is sampled
    sampling_requests: list[Request]  # [S], in the order of logits_indices


def _slots(item: ScheduledRequest, block_size: int) -> list[int]:
    return [item.block_ids[pos // block_size] * block_size + pos % block_size
            for pos in range(item.start, item.end)]


def prepare_inputs(plan: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    decodes = [s for s in plan.scheduled if s.num_new_tokens == 1]
    ordered = decodes + [s for s in plan.scheduled if s.num_new_tokens > 1]
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    chunks: list[PrefillChunk] = []
    logits_rows: list[int] = []
    sampling: list[Request] = []
    for item in ordered:
        row = len(token_ids)
        token_ids.extend(item.request.all_token_ids[item.start:item.end])
        positions.extend(range(item.start, item.end))
        slots.extend(_slots(item, block_size))
        if item.num_new_tokens > 1:
            block_ids = item.block_ids[:cdiv(item.end, block_size)]
            chunks.append(PrefillChunk(row, item.num_new_tokens, item.end,
                                       torch.tensor(block_ids, dtype=torch.long, device=device)))
        if item.samples:
            logits_rows.append(row + item.num_new_tokens - 1)
            sampling.append(item.request)

    def as_long(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    attn = AttentionMetadata(slot_mapping=as_long(slots), num_decodes=len(decodes),
                             prefills=chunks)
    if decodes:
        tables = [d.block_ids[:cdiv(d.end, block_size)] for d in decodes]
        width = max(len(t) for t in tables)
        attn = AttentionMetadata(
            slot_mapping=attn.slot_mapping, num_decodes=len(decodes), prefills=chunks,
            decode_block_tables=as_long([t + [0] * (width - len(t)) for t in tables]),
            decode_seq_lens=as_long([d.end for d in decodes]))
    return ModelInputs(as_long(token_ids), as_long(positions), attn, as_long(logits_rows),
                       sampling)
