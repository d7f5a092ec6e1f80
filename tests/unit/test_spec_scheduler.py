"""Speculative decoding in the token-budget loop, driven with fake runner results: the budget
counts drafts, rejected drafts give their blocks back unhashed, drafts stop at max_tokens and
when the step has many rows. No model, no torch."""
from __future__ import annotations

import pytest

from ember.config import SchedulerConfig, SpecConfig
from ember.errors import ConfigError
from ember.kv.kv_manager import KVCacheManager
from ember.request import FinishReason
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler
from tests.unit.test_scheduler import make_request


def make_spec_scheduler(token_budget: int = 64, num_blocks: int = 32, block_size: int = 4,
                        max_spec_rows: int = 8, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=token_budget),
                     KVCacheManager(num_blocks, block_size),
                     max_model_len=4096,
                     spec=SpecConfig(speculative="ngram", max_spec_rows=max_spec_rows))


def result(plan: SchedulerOutput, tokens: dict[str, list[int]],
           drafts: dict[str, list[int]] | None = None) -> RunnerOutput:
    out = RunnerOutput(draft_token_ids=drafts or {})
    for item in plan.scheduled:
        if item.samples:
            out.sampled_token_ids[item.request.request_id] = \
                tokens.get(item.request.request_id, [1])
    return out


def start(sched: Scheduler, request_id: str, num_prompt: int, drafts: list[int],
          max_tokens: int = 32) -> None:
    """Admit and prefill a request; the runner proposes `drafts` after its first token (other
    requests in the step get token 1 and no drafts)."""
    sched.add(make_request(request_id, num_prompt, max_tokens=max_tokens))
    plan = sched.schedule()
    sched.update(plan, result(plan, {request_id: [50]}, {request_id: drafts}))


def test_drafts_ride_in_the_next_step_and_count_in_the_budget():
    sched = make_spec_scheduler()
    start(sched, "a", 6, [60, 61, 62])
    plan = sched.schedule()
    (item,) = plan.scheduled
    assert (item.start, item.num_new_tokens, item.draft_token_ids) == (6, 4, (60, 61, 62))
    assert item.samples and plan.num_batched_tokens == 4


def test_rejected_drafts_give_back_their_blocks_unhashed():
    """6 prompt tokens + 1 output in blocks of 4: drafts reach position 10 (block 2); two of
    three accepted plus the model's token: 10 tokens, 9 computed. Then all rejected."""
    sched = make_spec_scheduler()
    start(sched, "a", 6, [60, 61, 62])
    request = sched.requests["a"]
    plan = sched.schedule()
    assert len(sched.kv.block_table("a")) == 3       # slots for positions 0..9
    free_before = sched.kv.num_free_blocks
    sched.update(plan, result(plan, {"a": [60, 61, 70]}, {"a": [80, 81, 82, 83]}))
    assert request.output_token_ids == [50, 60, 61, 70]
    assert request.num_computed_tokens == 9 and request.num_tokens == 10
    assert len(sched.kv.block_table("a")) == 3 and sched.kv.num_free_blocks == free_before
    assert sched.spec_stats.num_draft_tokens == 3 and sched.spec_stats.num_accepted_tokens == 2
    plan = sched.schedule()                         # positions 9..13: 5 blocks... 4 needed
    assert plan.scheduled[0].draft_token_ids == (80, 81, 82, 83)
    assert len(sched.kv.block_table("a")) == 4
    sched.update(plan, result(plan, {"a": [90]}, {}))   # every draft rejected
    assert request.num_computed_tokens == 10 and request.num_tokens == 11
    assert len(sched.kv.block_table("a")) == 3       # block 3 (positions 12..15) went back
    # only whole blocks of accepted tokens are hashed: blocks 0 and 1 (tokens 0..7)
    assert sched.kv._num_cached["a"] == 2


def test_drafts_stop_at_max_tokens():
    sched = make_spec_scheduler()
    start(sched, "a", 6, [60, 61, 62, 63], max_tokens=3)   # 1 output, 2 more allowed
    plan = sched.schedule()
    assert plan.scheduled[0].draft_token_ids == (60,)      # one draft + the model's token
    sched.update(plan, result(plan, {"a": [60, 61]}))
    assert sched.requests == {}                            # finished at max_tokens


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    sched = make_spec_scheduler()
    start(sched, "a", 6, [60, 2, 62])
    request = sched.requests["a"]
    plan = sched.schedule()
    sched.update(plan, result(plan, {"a": [60, 2, 62, 70]}))
    assert request.output_token_ids == [50, 60, 2] and request.is_finished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_large_step_verifies_no_drafts():
    """max_spec_rows=4 with three requests running: one row left for drafts, given in rank
    order; a fourth request leaves none."""
    sched = make_spec_scheduler(max_spec_rows=4)
    for rid in ("a", "b", "c"):
        start(sched, rid, 6, [60, 61])
    for request in sched.running:   # as if the last step proposed for each
        request.draft_token_ids = [60, 61]
    plan = sched.schedule()
    assert [s.draft_token_ids for s in plan.scheduled] == [(60,), (), ()]
    sched.update(plan, result(plan, {"a": [60, 1], "b": [1], "c": [1]},
                              {r: [60, 61] for r in "abc"}))
    start(sched, "d", 6, [60, 61])
    plan = sched.schedule()
    assert all(not s.draft_token_ids for s in plan.scheduled)


def test_a_request_whose_drafts_fail_pauses_drafting():
    sched = make_spec_scheduler()
    start(sched, "a", 6, [60, 61, 62, 63])
    request = sched.requests["a"]
    plan = sched.schedule()
    sched.update(plan, result(plan, {"a": [1]}, {"a": [60, 61, 62, 63]}))
    assert request.spec_acceptance < 0.8
    for _ in range(3):          # rejected again and again: the running share falls under 0.3
        plan = sched.schedule()
        sched.update(plan, result(plan, {"a": [1]}, {"a": [60, 61, 62, 63]}))
    assert request.spec_pause > 0 and request.draft_token_ids == []
    plan = sched.schedule()
    assert plan.scheduled[0].draft_token_ids == ()


def test_a_drafting_model_gets_slots_past_the_step_while_blocks_are_plenty():
    """A model that drafts writes K and V of its drafts after the step: a request that samples
    gets `num_speculative_tokens` slots past it (6 prompt tokens + 4 ahead: 3 blocks of 4),
    and none when the free blocks are few; they all come back when it finishes."""
    for num_blocks, want in ((32, 3), (3, 2)):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          KVCacheManager(num_blocks, 4), max_model_len=4096,
                          spec=SpecConfig(speculative="self", num_speculative_tokens=4))
        sched.add(make_request("a", 6, max_tokens=4))
        plan = sched.schedule()
        assert len(plan.scheduled[0].block_ids) == want
        assert len(sched.kv.block_table("a")) == want
        sched.finish("a", FinishReason.ABORT)
        assert sched.kv.num_free_blocks == num_blocks


def test_spec_config_names_the_proposer_and_the_draft_model():
    assert SpecConfig(speculative="draft:/m/small.gguf").proposer == "draft"
    assert SpecConfig(speculative="draft:/m/small.gguf").draft_model_path == "/m/small.gguf"
    assert SpecConfig(speculative="self").drafts_with_a_model
    assert not SpecConfig(speculative="ngram").drafts_with_a_model
    for bad, layers, match in (("draft:", None, "names no model"),
                               ("eagle", None, "choose one of ngram, self"),
                               ("self", 0, "self_draft_layers=0")):
        with pytest.raises(ConfigError, match=match):
            SpecConfig(speculative=bad, self_draft_layers=layers)
