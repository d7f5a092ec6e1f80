"""SchedulerOutput -> flat tensors for one forward pass. All the index maths lives here.

The step's tokens are laid out in one flat batch, in scheduled order:

    request:   d0 | p0 p0 p0 p0 | d1 | p1 p1 p1
    row:        0 |  1  2  3  4 |  5 |  6  7  8

A request's new token at position `pos` goes to cache slot
`block_ids[pos // block_size] * block_size + pos % block_size`. The logits rows are the last new
token of each request that samples (a leading prefill chunk samples nothing).

Attention: a request whose chunk starts a prompt is a FreshChunk; every other one (decodes,
continued prefills) joins an AttentionGroup. Groups gather requests of similar shape, so that
padding each member's queries to the longest and its context to the widest wastes little:
a group stays within GROUP_WASTE times the work of attending its members one by one.
A step that only decodes also lists all its requests in row order (DecodeBatch), for the
compiled decode stack, which attends them in one call whatever their lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ember.kv.kv_manager import cdiv
from ember.models.attention import (MATMUL_MAX_QUERIES, AttentionGroup, AttentionMetadata,
                                    DecodeBatch, FreshChunk)
from ember.request import Request
from ember.scheduler.output import ScheduledRequest, SchedulerOutput

GROUP_WASTE = 2.0


@dataclass(frozen=True)
class ModelInputs:
    input_ids: Tensor        # [T] long
    positions: Tensor        # [T] long
    attn: AttentionMetadata
    logits_indices: Tensor   # [S] long: rows whose next-token distribution is sampled
    sampling_requests: list[Request]  # [S], in the order of logits_indices


@dataclass(frozen=True)
class _Member:
    row: int          # first row in the flat batch
    num_new: int
    seq_len: int      # context after this step
    block_ids: list[int]


def _slots(item: ScheduledRequest, block_size: int) -> list[int]:
    return [item.block_ids[pos // block_size] * block_size + pos % block_size
            for pos in range(item.start, item.end)]


def group_members(members: list[_Member]) -> list[list[_Member]]:
    """Sort by shape and cut into groups whose padded work stays within GROUP_WASTE times
    the members' own work (new tokens x context)."""
    # a member with many new tokens (a continued prompt) attends alone: one member's plain
    # matmuls beat a padded multi-member kernel call at these sizes (docs/benchmarks.md)
    alone = [[m] for m in members if m.num_new > MATMUL_MAX_QUERIES]
    members = [m for m in members if m.num_new <= MATMUL_MAX_QUERIES]
    if members and _cheap_enough(members):
        return [members] + alone  # in batch order: a step of decodes needs no row indexing
    groups: list[list[_Member]] = alone
    current: list[_Member] = []
    for m in sorted(members, key=lambda m: (m.num_new, m.seq_len)):
        trial = current + [m]
        if current and not _cheap_enough(trial):
            groups.append(current)
            trial = [m]
        current = trial
    if current:
        groups.append(current)
    return groups


def _cheap_enough(group: list[_Member]) -> bool:
    padded = len(group) * max(x.num_new for x in group) * max(x.seq_len for x in group)
    return padded <= GROUP_WASTE * sum(x.num_new * x.seq_len for x in group)


def _block_tables(members: list[_Member], block_size: int) -> Tensor:
    """[G, widest] long: each member's context blocks, 0-padded."""
    width = max(cdiv(m.seq_len, block_size) for m in members)
    return torch.tensor([m.block_ids[:cdiv(m.seq_len, block_size)] +
                         [0] * (width - cdiv(m.seq_len, block_size)) for m in members],
                        dtype=torch.long)


def build_group(members: list[_Member], block_size: int, device: torch.device,
                num_rows: int) -> AttentionGroup:
    """One group's tensors; `num_rows` is the step's flat batch size. Plain lists first:
    a step of decodes (every member one new token) builds in a few small tensors."""
    max_n = max(m.num_new for m in members)
    row_lists = [[m.row + min(i, m.num_new - 1) for i in range(max_n)] for m in members]
    rows = torch.tensor(row_lists, dtype=torch.long)
    tables = _block_tables(members, block_size)
    seq_lens = torch.tensor([m.seq_len for m in members], dtype=torch.long)
    num_new = torch.tensor([m.num_new for m in members], dtype=torch.long)
    no_padding = all(m.num_new == max_n for m in members)
    if no_padding:
        valid, out_rows = torch.ones(rows.shape, dtype=torch.bool), rows.view(-1)
    else:
        valid = torch.arange(max_n)[None, :] < num_new[:, None]
        out_rows = rows[valid]
    whole_batch = no_padding and [r for rs in row_lists for r in rs] == list(range(num_rows))
    lone = (members[0].row, members[0].seq_len) if len(members) == 1 else None
    return AttentionGroup(rows.to(device), valid.to(device), tables.to(device),
                          out_rows.to(device), seq_lens.to(device), num_new.to(device),
                          block_size, whole_batch, lone)


def prepare_inputs(plan: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    fresh: list[FreshChunk] = []
    members: list[_Member] = []
    logits_rows: list[int] = []
    sampling: list[Request] = []
    for item in plan.scheduled:
        row = len(token_ids)
        token_ids.extend(item.request.all_token_ids[item.start:item.end])
        positions.extend(range(item.start, item.end))
        slots.extend(_slots(item, block_size))
        if item.start == 0 and item.num_new_tokens > 1:
            table = item.block_ids[:cdiv(item.end, block_size)]
            fresh.append(FreshChunk(row, item.num_new_tokens,
                                    torch.tensor(table, dtype=torch.long, device=device)))
        else:
            members.append(_Member(row, item.num_new_tokens, item.end, item.block_ids))
        if item.samples:
            logits_rows.append(row + item.num_new_tokens - 1)
            sampling.append(item.request)

    def as_long(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    groups = [build_group(g, block_size, device, len(token_ids))
              for g in group_members(members)]
    decodes = None
    if not fresh and all(m.num_new == 1 for m in members):
        if len(groups) == 1 and groups[0].whole_batch:  # the usual case: that group is it
            decodes = DecodeBatch(groups[0].block_tables, groups[0].seq_lens)
        else:
            decodes = DecodeBatch(_block_tables(members, block_size).to(device),
                                  as_long([m.seq_len for m in members]))
    attn = AttentionMetadata(slot_mapping=as_long(slots), fresh=fresh, groups=groups,
                             decodes=decodes)
    return ModelInputs(as_long(token_ids), as_long(positions), attn, as_long(logits_rows),
                       sampling)
