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
compiled decode stack, which attends them in one call whatever their lengths; a step with
prompt chunks, where its decodes lie on adjacent rows and every continued chunk attends alone,
lists its decodes and chunks for the same stack (PromptStep).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ember.kv.kv_manager import BlockCopy, cdiv
from ember.models.attention import (MATMUL_MAX_QUERIES, AttentionGroup, AttentionMetadata,
                                    DecodeBatch, FreshChunk, PromptStep)
from ember.models.parallel import HeadShare
from ember.request import Request
from ember.scheduler.output import ScheduledRequest, SchedulerOutput

GROUP_WASTE = 2.0


@dataclass(frozen=True)
class ModelInputs:
    input_ids: Tensor        # [T] long
    positions: Tensor        # [T] long
    attn: AttentionMetadata
    logits_indices: Tensor | None  # [S] long: rows whose next-token distribution is
    #                                sampled; None: every row, in order (a step of decodes)
    sampling_requests: list[Request]  # in the order of logits_indices
    # rows of logits per sampling request, where any has speculative drafts (1 + its drafts:
    # the distributions after its newest token and after each draft); None: one each
    rows_per_request: list[int] | None = None


@dataclass(frozen=True)
class _Member:
    row: int          # first row in the flat batch
    num_new: int
    seq_len: int      # context after this step
    block_ids: list[int]
    decode: bool = True   # a decode row (else a prompt chunk)


def _slots(item: ScheduledRequest, block_size: int) -> list[int]:
    return [item.block_ids[pos // block_size] * block_size + pos % block_size
            for pos in range(item.start, item.end)]


def alone_above(chunks_alone: bool) -> int:
    """The new tokens past which a member (a continued prompt chunk) attends alone: any
    several where the prefill kernel attends prompt chunks (`chunks_alone`), else more than
    MATMUL_MAX_QUERIES (one member's plain matmuls beat a padded multi-member call there)."""
    return 1 if chunks_alone else MATMUL_MAX_QUERIES


def _attends_alone(m: _Member, alone_past: int, prompts_alone: bool) -> bool:
    """A member of more than `alone_past` new tokens (alone_above) attends alone, and so
    does every prompt chunk where `prompts_alone` (by_kind, on the prefill kernel: a prompt
    row attends there however few rows its chunk has, so that its output does not depend on
    the chunk size)."""
    return m.num_new > alone_past or (prompts_alone and not m.decode)


def group_members(members: list[_Member], alone_past: int = MATMUL_MAX_QUERIES,
                  prompts_alone: bool = False) -> list[list[_Member]]:
    """Sort by shape and cut into groups whose padded work stays within GROUP_WASTE times
    the members' own work (new tokens x context); some attend alone (_attends_alone)."""
    alone = [[m] for m in members if _attends_alone(m, alone_past, prompts_alone)]
    members = [m for m in members if not _attends_alone(m, alone_past, prompts_alone)]
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


class _LongColumns:
    """A step's int64 index columns, gathered as lists and made into one tensor, then handed
    back as views: one allocation and one copy to the device instead of one per column. In a
    decode step each torch call costs tens of microseconds (the weights have just streamed
    through the caches), and a batch-1 step made ten of these."""

    def __init__(self) -> None:
        self._values: list[int] = []
        self._shapes: list[tuple[int, ...]] = []

    def add(self, values: list[int], shape: tuple[int, ...] | None = None) -> int:
        """Queue `values` (laid out as `shape`, default flat); returns its index in build()."""
        self._values.extend(values)
        self._shapes.append(shape if shape is not None else (len(values),))
        return len(self._shapes) - 1

    def build(self, device: torch.device) -> list[Tensor]:
        flat = np.array(self._values, dtype=np.int64)
        if device.type == "cpu":   # numpy's slices, each wrapped: no torch op per column
            columns, start = [], 0   # (a batch-1 decode step's columns 55 -> 38 us)
            for shape in self._shapes:
                size = math.prod(shape)
                columns.append(torch.from_numpy(flat[start:start + size].reshape(shape)))
                start += size
            return columns
        on_device = torch.from_numpy(flat).to(device)
        sizes = [math.prod(shape) for shape in self._shapes]
        return [t if len(shape) == 1 else t.view(shape)
                for t, shape in zip(on_device.split(sizes), self._shapes)]


def _block_tables(members: list[_Member], block_size: int, columns: _LongColumns) -> int:
    """[G, widest]: each member's context blocks, 0-padded (queued in `columns`)."""
    width = max(cdiv(m.seq_len, block_size) for m in members)
    table: list[int] = []
    for m in members:
        used = cdiv(m.seq_len, block_size)
        table += m.block_ids[:used] + [0] * (width - used)
    return columns.add(table, (len(members), width))


@dataclass(frozen=True)
class _GroupColumns:
    """One group's columns, queued; group() makes the AttentionGroup once they are built."""

    rows: int
    valid: int
    tables: int
    out_rows: int
    seq_lens: int
    num_new: int
    whole_batch: bool
    lone: tuple[int, int] | None
    span: tuple[int, int] | None
    prompt: bool

    def group(self, built: list[Tensor], block_size: int) -> AttentionGroup:
        return AttentionGroup(built[self.rows], built[self.valid], built[self.tables],
                              built[self.out_rows], built[self.seq_lens], built[self.num_new],
                              block_size, self.whole_batch, self.lone, self.span, self.prompt)


def queue_group(members: list[_Member], block_size: int, num_rows: int,
                columns: _LongColumns) -> _GroupColumns:
    """One group's index lists, queued in `columns`; `num_rows` is the step's flat batch size."""
    max_n = max(m.num_new for m in members)
    row_lists = [[m.row + min(i, m.num_new - 1) for i in range(max_n)] for m in members]
    flat_rows = [r for rs in row_lists for r in rs]
    valid = [int(i < m.num_new) for m in members for i in range(max_n)]
    out_rows = [r for r, ok in zip(flat_rows, valid) if ok]
    whole_batch = len(out_rows) == len(flat_rows) and flat_rows == list(range(num_rows))
    lone = (members[0].row, members[0].seq_len) if len(members) == 1 else None
    first = out_rows[0]
    span = (first, len(out_rows)) if max_n == 1 and \
        out_rows == list(range(first, first + len(out_rows))) else None
    return _GroupColumns(columns.add(flat_rows, (len(members), max_n)),
                         columns.add(valid, (len(members), max_n)),
                         _block_tables(members, block_size, columns), columns.add(out_rows),
                         columns.add([m.seq_len for m in members]),
                         columns.add([m.num_new for m in members]), whole_batch, lone, span,
                         not any(m.decode for m in members))


def _queue_prompt_step(fresh: list[tuple[int, int, int]], members: list[_Member],
                       block_size: int, columns: _LongColumns, alone_past: int,
                       prompts_alone: bool) -> tuple[int, int, int, int, list[int]] | None:
    """A step with prompt chunks as PromptStep lays it out (its columns queued): where the
    decodes lie on adjacent rows and every continued chunk attends alone, as the layers
    attend it too (group_members); else None."""
    decodes = [m for m in members if m.decode]
    chunks = [m for m in members if not m.decode]
    if not all(_attends_alone(m, alone_past, prompts_alone) for m in chunks):
        return None
    first = decodes[0].row if decodes else 0
    if [m.row for m in decodes] != list(range(first, first + len(decodes))):
        return None
    info = [v for row, n, _ in fresh for v in (row, n, n, 1)]
    info += [v for m in chunks for v in (m.row, m.num_new, m.seq_len, 0)]
    chunk_tables = [table for _, _, table in fresh]
    chunk_tables += [columns.add(m.block_ids[:cdiv(m.seq_len, block_size)]) for m in chunks]
    tables = _block_tables(decodes, block_size, columns) if decodes else \
        columns.add([], (0, 1))
    return (first, tables, columns.add([m.seq_len for m in decodes]),
            columns.add(info, (len(info) // 4, 4)), chunk_tables)


def _decode_rows(scheduled: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int]]:
    """A step of decodes as rows: (item, position). A request with drafts verifies them on
    rows of their own, one per position, each attending over the context up to it:

        request with newest token x at position p and drafts d0 d1:
        row:       x     d0     d1
        position:  p     p+1    p+2
        seq_len:   p+1   p+2    p+3     (each row reads the k and v the rows before it wrote)
    """
    return [(item, item.start + j) for item in scheduled for j in range(item.num_new_tokens)]


def _skip_rows(scheduled: list[ScheduledRequest], share: HeadShare | None,
               columns: _LongColumns) -> int | None:
    """Where `share` is set: each row's KV heads left to another rank (HeadShare.skip_bits
    of its request), queued in `columns`, one per new token in the flat batch's order."""
    if share is None:
        return None
    return columns.add([bits for item in scheduled
                        for bits in [share.skip_bits(item.request.share_key)]
                        * item.num_new_tokens])


def _decode_inputs(plan: SchedulerOutput, block_size: int, device: torch.device,
                   share: HeadShare | None = None) -> ModelInputs:
    """A step of decodes laid out for the decode stack alone: ids, positions, slots and the
    DecodeBatch, no attention groups (the stack attends the whole batch in one call). Five
    columns where the general layout builds nine, and none of its grouping: a batch-1 step's
    inputs took ~130 us on cold caches before this layout, about half that with it."""
    scheduled = plan.scheduled
    rows = _decode_rows(scheduled)
    columns = _LongColumns()
    members = [_Member(row, 1, pos + 1, item.block_ids) for row, (item, pos) in enumerate(rows)]
    flat = [columns.add([_token_at(item, pos) for item, pos in rows]),
            columns.add([pos for _, pos in rows]),
            columns.add([item.block_ids[pos // block_size] * block_size + pos % block_size
                         for item, pos in rows]),
            _block_tables(members, block_size, columns),
            columns.add([pos + 1 for _, pos in rows])]
    logits_rows = [row for row, (item, pos) in enumerate(rows)
                   if item.samples and pos >= item.end - 1 - len(item.draft_token_ids)]
    logits = None if len(logits_rows) == len(rows) else columns.add(logits_rows)
    skip = _skip_rows(scheduled, share, columns)
    built = columns.build(device)
    attn = AttentionMetadata(slot_mapping=built[flat[2]],
                             decodes=DecodeBatch(built[flat[3]], built[flat[4]]),
                             skip=None if skip is None else built[skip])
    return ModelInputs(built[flat[0]], built[flat[1]], attn,
                       None if logits is None else built[logits],
                       [item.request for item in scheduled if item.samples],
                       rows_per_request(scheduled))


def _token_at(item: ScheduledRequest, pos: int) -> int:
    """The input token at `pos` of a scheduled request: its own, or one of its drafts."""
    num_own = item.num_new_tokens - len(item.draft_token_ids)
    if pos < item.start + num_own:
        return item.request.all_token_ids[pos]
    return item.draft_token_ids[pos - item.start - num_own]


def rows_per_request(scheduled: list[ScheduledRequest]) -> list[int] | None:
    """Logits rows of each sampling request, in order, where any verifies drafts (1 + its
    drafts); None where every one has a single row."""
    if not any(item.draft_token_ids for item in scheduled):
        return None
    return [1 + len(item.draft_token_ids) for item in scheduled if item.samples]


def _is_decode(item: ScheduledRequest, by_kind: bool = False) -> bool:
    """Whether the item's rows attend as decodes, one row per position: by_kind, where its
    tokens are generated ones (by_kind_parts keeps prompt and generated tokens apart);
    else where it has one new token of its own (plus any drafts)."""
    if by_kind:
        return item.start >= item.request.num_prompt_tokens
    return item.num_new_tokens - len(item.draft_token_ids) == 1


def by_kind_parts(plan: SchedulerOutput) -> list[tuple[bool, SchedulerOutput]]:
    """The plan as one step of prompt rows and one of decode rows, (True, prompt part) then
    (False, decode part), each left out where it has none, to run in that order: a prompt
    token's rows take the prompt path whatever else the step holds, a generated token's the
    decode path, so that every row's numerics are a function of the row alone. A request
    recomputing its generated tokens after a preemption has both; its prompt part runs
    first, whose KV its decode rows read."""
    prompt: list[ScheduledRequest] = []
    decode: list[ScheduledRequest] = []
    for item in plan.scheduled:
        num_prompt = item.request.num_prompt_tokens
        if item.end <= num_prompt or item.request.pooling is not None:
            prompt.append(item)
        elif item.start >= num_prompt:
            decode.append(item)
        else:
            head = num_prompt - item.start
            prompt.append(replace(item, num_new_tokens=head, samples=False,
                                  draft_token_ids=()))
            decode.append(replace(item, start=num_prompt,
                                  num_new_tokens=item.num_new_tokens - head))
    return [(kind, SchedulerOutput(items, plan.finished_request_ids))
            for kind, items in ((True, prompt), (False, decode)) if items]


def micro_batches(plan: SchedulerOutput, count: int) -> list[SchedulerOutput]:
    """The plan's requests in order, cut into at most `count` runs of about equal new
    tokens (a request is never split), for pipeline stages to work on one run while the next
    stage works on the one before."""
    total = sum(item.num_new_tokens for item in plan.scheduled)
    runs: list[list[ScheduledRequest]] = [[]]
    done = 0
    for item in plan.scheduled:
        if runs[-1] and done >= total * len(runs) / count:
            runs.append([])
        runs[-1].append(item)
        done += item.num_new_tokens
    return [SchedulerOutput(items, plan.finished_request_ids) for items in runs]


def prepare_inputs(plan: SchedulerOutput, block_size: int, device: torch.device,
                   decode_stack: bool = False, chunks_alone: bool = False,
                   by_kind: bool = False, share: HeadShare | None = None) -> ModelInputs:
    """The step's flat inputs. With `decode_stack` (the model runs every step of decodes in
    its decode stack), such a step gets only what the stack reads (no attention groups).
    With `chunks_alone` (the model attends prompt chunks on the compiled prefill kernel),
    every continued chunk attends alone, however few its new tokens: after a prefix-cache
    hit a prompt's own tokens may be only a few, and a chunk grouped with decodes made the
    whole step leave the decode stack and attend each chunk's context apart (a step of 8
    such prompts 1.3x the time). With `by_kind` (a part of by_kind_parts), rows are prompt
    or decode rows by their tokens, not by how many a request has in the step, and with
    `chunks_alone` too, a prompt's first chunk attends over its k and v as the cache holds
    them, as every later chunk does. With `share` (a tensor-parallel rank sharing a KV head
    with another), each row's KV heads left to the other rank (AttentionMetadata.skip)."""
    if decode_stack and plan.scheduled and \
            all(_is_decode(item, by_kind) for item in plan.scheduled):
        return _decode_inputs(plan, block_size, device, share)
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    fresh: list[tuple[int, int, int]] = []   # row, tokens, block table column
    members: list[_Member] = []
    logits_rows: list[int] = []
    sampling: list[Request] = []
    columns = _LongColumns()
    for item in plan.scheduled:
        row = len(token_ids)
        token_ids.extend(_token_ids(item))
        positions.extend(range(item.start, item.end))
        slots.extend(_slots(item, block_size))
        decode = _is_decode(item, by_kind)
        if item.start == 0 and not decode and not (by_kind and chunks_alone) and \
                item.num_new_tokens > 1:
            table = columns.add(item.block_ids[:cdiv(item.end, block_size)])
            fresh.append((row, item.num_new_tokens, table))
        elif item.draft_token_ids or (decode and item.num_new_tokens > 1):
            # verified drafts, or generated tokens recomputed: decodes, a row per position
            members += [_Member(row + j, 1, item.start + j + 1, item.block_ids)
                        for j in range(item.num_new_tokens)]
        else:
            members.append(_Member(row, item.num_new_tokens, item.end, item.block_ids,
                                   decode if by_kind else item.num_new_tokens == 1))
        if item.samples:
            num_rows = 1 + len(item.draft_token_ids)
            logits_rows.extend(range(row + item.num_new_tokens - num_rows,
                                     row + item.num_new_tokens))
            sampling.append(item.request)
    past, prompts_alone = alone_above(chunks_alone), by_kind and chunks_alone
    queued = [queue_group(g, block_size, len(token_ids), columns)
              for g in group_members(members, past, prompts_alone)]
    decode_columns = None
    if not fresh and all(m.decode for m in members):
        if len(queued) == 1 and queued[0].whole_batch:  # the usual case: that group is it
            decode_columns = (queued[0].tables, queued[0].seq_lens)
        else:
            decode_columns = (_block_tables(members, block_size, columns),
                              columns.add([m.seq_len for m in members]))
    prompt_columns = None if decode_columns is not None else \
        _queue_prompt_step(fresh, members, block_size, columns, past, prompts_alone)
    flat = [columns.add(c) for c in (token_ids, positions, slots)]
    # a step whose every row samples, in order, takes its logits from all of them
    logits = None if logits_rows == list(range(len(token_ids))) else columns.add(logits_rows)
    skip = _skip_rows(plan.scheduled, share, columns)
    built = columns.build(device)
    decodes = None if decode_columns is None else \
        DecodeBatch(built[decode_columns[0]], built[decode_columns[1]])
    prompt_step = None
    if prompt_columns is not None:
        first, tables, lens, info, chunk_tables = prompt_columns
        prompt_step = PromptStep(first, built[tables], built[lens], built[info],
                                 [built[c] for c in chunk_tables])
    attn = AttentionMetadata(
        slot_mapping=built[flat[2]],
        fresh=[FreshChunk(row, n, built[table]) for row, n, table in fresh],
        groups=[g.group(built, block_size) for g in queued], decodes=decodes,
        prompt_step=prompt_step, skip=None if skip is None else built[skip])
    return ModelInputs(built[flat[0]], built[flat[1]], attn,
                       None if logits is None else built[logits], sampling,
                       rows_per_request(plan.scheduled))


def copy_slot_batches(copies: list[BlockCopy], block_size: int, device: torch.device
                      ) -> list[tuple[Tensor, Tensor]]:
    """A step's block copies (partial prefix-cache hits) as batches of (src slots, dst slots)
    [N] long, each batch read whole before it is written: one batch for the whole step, or one
    per copy where a copy writes a block another reads (the copies then go in their order)."""
    if not copies:
        return []
    written = {c.dst for c in copies if c.dst != c.src}
    batches = [copies] if not written & {c.src for c in copies} else [[c] for c in copies]
    out = []
    for batch in batches:
        src = [c.src * block_size + i for c in batch for i in range(c.num_tokens)]
        dst = [c.dst * block_size + i for c in batch for i in range(c.num_tokens)]
        both = torch.tensor([src, dst], dtype=torch.long, device=device)
        out.append((both[0], both[1]))
    return out


def _token_ids(item: ScheduledRequest) -> list[int]:
    """The step's input tokens of one request: its own, then its drafts (if any)."""
    if not item.draft_token_ids:
        return item.request.all_token_ids[item.start:item.end]
    end = item.end - len(item.draft_token_ids)
    return item.request.all_token_ids[item.start:end] + list(item.draft_token_ids)
