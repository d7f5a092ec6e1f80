"""prepare_inputs: a step's decodes beside prompt chunks are found by a slice of rows (span)
where they lie together, and by their row indices where they do not. And a step's block copies
(partial prefix-cache hits) batched, against copying them one by one in order."""
from __future__ import annotations

import pytest
import torch

from ember.kv.kv_manager import BlockCopy
from ember.models.attention import PagedKV
from ember.runner.inputs import copy_slot_batches, prepare_inputs
from ember.scheduler.output import ScheduledRequest, SchedulerOutput
from tests.unit.test_scheduler import make_request

BLOCK = 16


def decode(request_id: str, context: int, first_block: int) -> ScheduledRequest:
    """A request whose prompt of `context` tokens is computed, decoding its newest token
    (contexts of similar length: one group, as group_members keeps them)."""
    request = make_request(request_id, context)
    request.output_token_ids.append(7)
    request.all_token_ids.append(7)
    blocks = list(range(first_block, first_block + context // BLOCK + 1))
    return ScheduledRequest(request, context, 1, blocks, samples=True)


def chunk(request_id: str, start: int, num: int, first_block: int) -> ScheduledRequest:
    """A prompt chunk of `num` tokens from `start` (0: a fresh prompt)."""
    request = make_request(request_id, start + num + 50)
    blocks = list(range(first_block, first_block + (start + num) // BLOCK + 1))
    return ScheduledRequest(request, start, num, blocks, samples=False)


def decode_group(plan: SchedulerOutput):
    groups = prepare_inputs(plan, BLOCK, torch.device("cpu")).attn.groups
    return next(g for g in groups if g.rows.shape[1] == 1)


def test_decodes_before_a_fresh_prompt_chunk_are_one_span_of_rows():
    plan = SchedulerOutput([decode("a", 40, 0), decode("b", 45, 10), decode("c", 38, 20),
                            chunk("p", 0, 30, 30)])
    group = decode_group(plan)
    assert group.span == (0, 3) and not group.whole_batch
    assert group.out_rows.tolist() == list(range(3))[group.out_index]
    out = torch.zeros(33)
    out[group.out_index] = torch.tensor([1.0, 2.0, 3.0])
    assert out[:4].tolist() == [1.0, 2.0, 3.0, 0.0]


def test_decodes_on_both_sides_of_a_continued_chunk_keep_their_row_indices():
    plan = SchedulerOutput([decode("a", 40, 0), chunk("p", 32, 40, 10), decode("b", 44, 20)])
    group = decode_group(plan)
    assert group.span is None
    assert group.out_rows.tolist() == [0, 41]
    assert torch.equal(group.out_index, group.out_rows)


def test_a_step_of_decodes_only_is_the_whole_batch_and_one_span():
    plan = SchedulerOutput([decode("a", 40, 0), decode("b", 45, 10)])
    group = decode_group(plan)
    assert group.whole_batch and group.span == (0, 2)
    q = torch.arange(2.0)
    assert q[group.out_index].data_ptr() == q.data_ptr()  # a view of every row, no copy


def prompt_step(plan: SchedulerOutput):
    return prepare_inputs(plan, BLOCK, torch.device("cpu")).attn.prompt_step


def test_a_step_with_prompt_chunks_is_laid_out_for_the_stack():
    """Decodes on adjacent rows, a fresh chunk and a continued one (more than 16 new tokens:
    it attends alone): the decodes' block tables and lengths in row order, one chunk_info
    row per chunk (first row, new tokens, seq_len, fresh) and each chunk's blocks."""
    plan = SchedulerOutput([decode("a", 40, 0), decode("b", 20, 10), chunk("p", 0, 30, 30),
                            chunk("q", 32, 40, 40)])
    step = prompt_step(plan)
    assert step.decode_first == 0
    assert step.block_tables.tolist() == [[0, 1, 2], [10, 11, 0]]
    assert step.seq_lens.tolist() == [41, 21]
    assert step.chunk_info.tolist() == [[2, 30, 30, 1], [32, 40, 72, 0]]
    assert [t.tolist() for t in step.chunk_tables] == [[30, 31], [40, 41, 42, 43, 44]]
    assert prepare_inputs(plan, BLOCK, torch.device("cpu")).attn.decodes is None


def test_a_prompt_step_without_decodes_or_that_the_stack_cannot_lay_out():
    alone = prompt_step(SchedulerOutput([chunk("p", 0, 30, 0)]))
    assert alone.block_tables.shape == (0, 1) and alone.seq_lens.numel() == 0
    assert alone.chunk_info.tolist() == [[0, 30, 30, 1]]
    # decodes on both sides of a chunk; a continued chunk of 16 tokens (grouped with decodes)
    assert prompt_step(SchedulerOutput([decode("a", 40, 0), chunk("p", 32, 40, 10),
                                        decode("b", 44, 20)])) is None
    assert prompt_step(SchedulerOutput([decode("a", 40, 0), chunk("p", 32, 16, 10)])) is None
    assert prompt_step(SchedulerOutput([decode("a", 40, 0), decode("b", 44, 20)])) is None


def test_short_continued_chunks_attend_alone_where_the_prefill_kernel_takes_them():
    """With chunks_alone, a continued chunk of a few tokens (a prompt's suffix after a
    prefix-cache hit) is laid out for the stack and is a group of its own, apart from the
    decodes; without, the stack gets no prompt step."""
    plan = SchedulerOutput([decode("a", 40, 0), decode("b", 44, 10), chunk("p", 32, 5, 20)])
    cpu = torch.device("cpu")
    alone = prepare_inputs(plan, BLOCK, cpu, chunks_alone=True).attn
    assert alone.prompt_step is not None and alone.prompt_step.decode_first == 0
    assert alone.prompt_step.chunk_info.tolist() == [[2, 5, 37, 0]]
    assert sorted(g.rows.shape[0] for g in alone.groups) == [1, 2]
    chunk_group = next(g for g in alone.groups if g.rows.shape[0] == 1)
    assert chunk_group.lone == (2, 37) and chunk_group.rows.tolist() == [[2, 3, 4, 5, 6]]
    assert prepare_inputs(plan, BLOCK, cpu).attn.prompt_step is None


def test_a_step_of_decodes_for_the_stack_gets_the_same_columns_and_no_groups():
    """With decode_stack, a step that only decodes gets what the stack reads, equal to the
    general layout's columns, and no attention groups; any other step ignores the flag."""
    cpu = torch.device("cpu")
    plan = SchedulerOutput([decode("a", 40, 0), decode("b", 75, 10), decode("c", 3, 20)])
    general = prepare_inputs(plan, BLOCK, cpu)
    lean = prepare_inputs(plan, BLOCK, cpu, decode_stack=True)
    assert lean.attn.groups == [] and lean.attn.fresh == [] and lean.attn.prompt_step is None
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(lean, name), getattr(general, name)), name
    assert torch.equal(lean.attn.slot_mapping, general.attn.slot_mapping)
    assert torch.equal(lean.attn.decodes.block_tables, general.attn.decodes.block_tables)
    assert torch.equal(lean.attn.decodes.seq_lens, general.attn.decodes.seq_lens)
    assert lean.attn.decodes.block_tables.tolist() == [[0, 1, 2, 0, 0], [10, 11, 12, 13, 14],
                                                       [20, 0, 0, 0, 0]]
    assert lean.logits_indices is None and general.logits_indices is None
    assert lean.sampling_requests == general.sampling_requests
    # a one-token row that does not sample (a prompt's leading chunk): logits rows named
    quiet = ScheduledRequest(make_request("q", 30), 20, 1, [30, 31], samples=False)
    lean = prepare_inputs(SchedulerOutput(plan.scheduled + [quiet]), BLOCK, cpu, True)
    assert lean.logits_indices.tolist() == [0, 1, 2] and len(lean.sampling_requests) == 3
    assert lean.attn.slot_mapping.tolist()[-1] == 31 * BLOCK + 4
    mixed = SchedulerOutput(plan.scheduled + [chunk("p", 0, 30, 30)])
    assert prepare_inputs(mixed, BLOCK, cpu, decode_stack=True).attn.groups


def copy_one_by_one(cache: PagedKV, copies: list[BlockCopy]) -> None:
    """The reference: each copy in order, block slices as the kv manager describes them."""
    for c in copies:
        cache.data[:, :, c.dst, :c.num_tokens] = cache.data[:, :, c.src, :c.num_tokens].clone()
        cache.scale[:, :, c.dst, :c.num_tokens] = cache.scale[:, :, c.src, :c.num_tokens].clone()


@pytest.mark.parametrize("copies", [
    [BlockCopy(3, 7, 5), BlockCopy(4, 8, 16), BlockCopy(3, 9, 2)],   # one batch: 23 slots
    [BlockCopy(5, 5, 9), BlockCopy(5, 2, 9)],        # a block copied onto itself, and read
    [BlockCopy(3, 7, 5), BlockCopy(7, 9, 4)]])       # the second reads what the first writes
def test_block_copies_of_a_step_equal_the_copies_one_by_one(copies):
    g = torch.Generator().manual_seed(5)
    want = PagedKV(torch.randint(-127, 127, (2, 3, 12, BLOCK, 8), dtype=torch.int8,
                                 generator=g), torch.rand(2, 3, 12, BLOCK, generator=g).half())
    got = PagedKV(want.data.clone(), want.scale.clone())
    copy_one_by_one(want, copies)
    batches = copy_slot_batches(copies, BLOCK, torch.device("cpu"))
    for src, dst in batches:
        got.copy_slots(src, dst)
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    chained = copies[1].src == copies[0].dst != copies[0].src
    assert len(batches) == (len(copies) if chained else 1)
    assert sum(len(src) for src, _ in batches) == sum(c.num_tokens for c in copies)


def test_by_kind_parts_run_prompt_rows_then_generated_ones_and_split_a_recompute():
    """A recomputing request (its prompt of 40 and 2 generated tokens, from 0) goes half into
    the prompt part (not sampling) and half into the decode part, rows of one position each."""
    from ember.runner.inputs import by_kind_parts
    again = decode("r", 40, 0)
    again.request.output_token_ids.append(9)
    again.request.all_token_ids.append(9)
    recompute = ScheduledRequest(again.request, 0, 42, again.block_ids, samples=True)
    plan = SchedulerOutput([decode("a", 40, 10), chunk("p", 32, 1, 20), recompute])
    (first, prompt), (second, generated) = by_kind_parts(plan)
    assert first and not second
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples)
            for s in prompt.scheduled] == [("p", 32, 1, False), ("r", 0, 40, False)]
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples)
            for s in generated.scheduled] == [("a", 40, 1, True), ("r", 40, 2, True)]
    cpu = torch.device("cpu")
    decodes = prepare_inputs(generated, BLOCK, cpu, decode_stack=True, by_kind=True).attn
    assert decodes.decodes.seq_lens.tolist() == [41, 41, 42]   # r's two rows in turn
    prompts = prepare_inputs(prompt, BLOCK, cpu, chunks_alone=True, by_kind=True).attn
    # a one-token prompt chunk (what a prefix-cache hit leaves) attends alone, as a prompt, and
    # a prompt's first chunk reads its k and v from the cache like any other
    assert not prompts.fresh and all(g.prompt and g.lone for g in prompts.groups)
    assert prompts.prompt_step is not None and prompts.prompt_step.chunk_info[:, 3].sum() == 0
