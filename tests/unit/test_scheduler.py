"""The token-budget loop, driven with fake runner results: no model, no torch."""
from __future__ import annotations

import pytest

from ember.config import SchedulerConfig
from ember.errors import ConfigError, ContextTooLong, InvalidRequest
from ember.kv.kv_manager import KVCacheManager
from ember.request import FinishReason, Request, RequestStatus, SamplingParams
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler

EOS = 2


def make_scheduler(token_budget: int = 64, num_blocks: int = 32, block_size: int = 16,
                   max_num_seqs: int = 8, max_model_len: int = 4096, caching: bool = True,
                   fair_share: bool = False, with_decodes: int | None = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=token_budget,
                                     prefill_tokens_with_decodes=with_decodes,
                                     fair_share=fair_share),
                     KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching),
                     max_model_len)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8,
                 prompt: list[int] | None = None, priority: int = 0, user: str | None = None,
                 **params) -> Request:
    """Each request id gets its own prompt tokens unless `prompt` is given."""
    base = 100 * (sum(map(ord, request_id)) % 97) + 1000
    return Request(request_id, prompt or list(range(base, base + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens, **params), frozenset({EOS}), max_tokens,
                   priority=priority, user=user)


def fake_result(plan: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """What a runner would return: one token for each request that reached its end."""
    out = RunnerOutput()
    for item in plan.scheduled:
        if item.samples:
            out.sampled_token_ids[item.request.request_id] = [token]
    return out


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    plan = sched.schedule()
    sched.update(plan, fake_result(plan, token))
    return plan


@pytest.mark.parametrize("with_decodes", [48, None])
def test_prompts_beside_decodes_get_the_smaller_chunk(with_decodes):
    """While a request decodes, a new prompt is cut to prefill_tokens_with_decodes per step
    (the decode's own token on top); alone, or with None, it gets the whole budget."""
    sched = make_scheduler(token_budget=128, num_blocks=64, with_decodes=with_decodes)
    sched.add(make_request("alone", num_prompt_tokens=100, max_tokens=20))
    assert step(sched).num_new_tokens == {"alone": 100}      # no decodes: the whole prompt
    sched.add(make_request("new", num_prompt_tokens=100))
    plan = step(sched)
    want = {"alone": 1, "new": 48} if with_decodes else {"alone": 1, "new": 100}
    assert plan.num_new_tokens == want
    if with_decodes:
        assert step(sched).num_new_tokens == {"alone": 1, "new": 48}
        assert step(sched).num_new_tokens == {"alone": 1, "new": 4}
    with pytest.raises(ConfigError, match="prefill_tokens_with_decodes"):
        SchedulerConfig(prefill_tokens_with_decodes=0)


def test_long_prompt_is_chunked():
    sched = make_scheduler(token_budget=64)
    sched.add(make_request("a", num_prompt_tokens=100))
    plan = step(sched)
    assert plan.num_new_tokens == {"a": 64}
    assert not plan.scheduled[0].samples
    plan = step(sched)
    assert plan.num_new_tokens == {"a": 36}
    assert plan.scheduled[0].samples
    assert sched.requests["a"].output_token_ids == [7]
    assert step(sched).num_new_tokens == {"a": 1}       # decoding now


def test_running_requests_go_first_and_newcomers_share_the_rest():
    sched = make_scheduler(token_budget=10)
    sched.add(make_request("a", 4))
    step(sched)                                          # a prefilled, has 1 token to decode
    sched.add(make_request("b", 30))
    plan = step(sched)
    assert plan.num_new_tokens == {"a": 1, "b": 9}       # decode first, b's prefill chunked
    assert step(sched).num_new_tokens == {"a": 1, "b": 9}


def test_block_counts_follow_tokens():
    sched = make_scheduler(token_budget=64, block_size=16)
    sched.add(make_request("a", 33))                     # 33 tokens: 3 blocks
    plan = step(sched)
    assert plan.scheduled[0].block_ids == [0, 1, 2]
    assert sched.kv.num_free_blocks == 29


def test_max_num_seqs_limits_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add(make_request(name, 4))
    assert set(step(sched).num_new_tokens) == {"a", "b"}
    assert sched.num_waiting == 1


def test_preemption_takes_the_newest_and_it_resumes_first():
    # 4 blocks of 4 tokens; each request needs 2 blocks to prefill, a third to grow
    sched = make_scheduler(token_budget=64, num_blocks=4, block_size=4)
    sched.add(make_request("a", 8, max_tokens=8))
    sched.add(make_request("b", 8, max_tokens=8))
    step(sched)                                          # both prefilled: all 4 blocks used
    assert sched.kv.num_free_blocks == 0
    plan = step(sched)                                   # a needs a block: b is preempted
    assert plan.num_new_tokens == {"a": 1}
    b = next(r for r in sched.waiting)
    assert b.request_id == "b" and b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert sched.num_preemptions == 1
    while "a" in sched.requests:
        step(sched)
    plan = step(sched)                                   # b recomputes prompt + its token
    assert plan.num_new_tokens == {"b": 9}               # (a evicted b's cached blocks)
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == 4


def test_a_preempted_request_resumes_from_what_stays_cached():
    # 5 blocks of 4: a and b prefill 2 each; a takes the 5th; b must grow and is preempted.
    # Its blocks go idle tail first, so when a grows again LRU evicts b's second block and
    # b resumes from its first: 9 tokens, 4 cached, 5 to compute.
    sched = make_scheduler(token_budget=64, num_blocks=5, block_size=4)
    sched.add(make_request("a", 8, max_tokens=8))
    sched.add(make_request("b", 8, max_tokens=8))
    step(sched)
    assert step(sched).num_new_tokens == {"a": 1} and sched.num_preemptions == 1
    while "a" in sched.requests:
        assert "b" not in step(sched).num_new_tokens
    assert step(sched).num_new_tokens == {"b": 5}
    assert sched.kv.num_hit_tokens >= 4

def test_the_oldest_request_preempts_itself_last():
    sched = make_scheduler(token_budget=64, num_blocks=2, block_size=4)
    sched.add(make_request("a", 4, max_tokens=4))
    sched.add(make_request("b", 4, max_tokens=4))
    step(sched)
    plan = step(sched)                                   # a grows into b's block
    assert plan.num_new_tokens == {"a": 1} and sched.waiting[0].request_id == "b"


def test_stops_on_eos_max_tokens_and_stop_token_ids():
    sched = make_scheduler()
    requests = {name: make_request(name, 4, **kw) for name, kw in [
        ("eos", {}), ("len", dict(max_tokens=2)), ("ign", dict(max_tokens=3, ignore_eos=True)),
        ("stop", dict(stop_token_ids=(7,))), ("min", dict(min_tokens=2))]}
    for r in requests.values():
        sched.add(r)
    step(sched, token=7)
    assert sched.requests.keys() == {"eos", "len", "ign", "min"}
    step(sched, token=EOS)
    assert sched.requests.keys() == {"ign"}
    step(sched, token=EOS)
    assert not sched.has_unfinished()
    reasons = {name: r.finish_reason for name, r in requests.items()}
    assert reasons == {"eos": FinishReason.STOP, "len": FinishReason.STOP,
                       "ign": FinishReason.LENGTH, "stop": FinishReason.STOP,
                       "min": FinishReason.STOP}
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_min_tokens_holds_back_eos():
    sched = make_scheduler()
    r = make_request("min", 4, min_tokens=2)
    sched.add(r)
    step(sched, token=EOS)
    assert not r.is_finished
    step(sched, token=EOS)
    assert r.finish_reason is FinishReason.STOP and len(r.output_token_ids) == 2


def test_stop_reasons_are_recorded():
    sched = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 4, max_tokens=1)
    sched.add(a)
    sched.add(b)
    step(sched, token=EOS)
    assert a.finish_reason is FinishReason.STOP and b.finish_reason is FinishReason.STOP
    c = make_request("c", 4, max_tokens=1)
    sched.add(c)
    step(sched, token=5)
    assert c.finish_reason is FinishReason.LENGTH


def test_abort_at_any_moment_frees_everything():
    sched = make_scheduler(token_budget=8, num_blocks=8, block_size=4)
    sched.add(make_request("waiting", 4))
    sched.add(make_request("chunked", 20))
    sched.add(make_request("decoding", 2))
    sched.finish("waiting", FinishReason.ABORT)
    step(sched)
    sched.add(make_request("queued", 4))
    plan = sched.schedule()
    sched.finish("decoding", FinishReason.ABORT)      # aborted while its step runs
    advanced = sched.update(plan, fake_result(plan))
    assert all(r.request_id != "decoding" for r in advanced)
    for name in list(sched.requests):
        sched.finish(name, FinishReason.ABORT)
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.schedule().finished_request_ids >= {"decoding", "chunked", "queued"}


def test_requests_that_can_never_fit_are_refused_up_front():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ContextTooLong, match="context holds 100"):
        sched.add(make_request("a", 95, max_tokens=10))
    with pytest.raises(ContextTooLong, match="whole KV cache holds 16"):
        sched.add(make_request("b", 10, max_tokens=10))
    sched.add(make_request("c", 10, max_tokens=6))
    with pytest.raises(InvalidRequest, match="already in use"):
        sched.add(make_request("c", 1))
    assert sched.num_waiting == 1


def run_to_end(sched: Scheduler, limit: int = 500) -> list[str]:
    """Step until idle; returns request ids in the order they finished."""
    done = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return done
        before = set(sched.requests)
        step(sched)
        done += sorted(before - set(sched.requests))
    raise AssertionError("the scheduler never drained")


def test_a_cached_prefix_is_skipped():
    sched = make_scheduler(token_budget=64, block_size=16)
    shared = list(range(500, 532))
    sched.add(make_request("a", 40, prompt=shared + [1] * 8))
    run_to_end(sched)
    b = make_request("b", 40, prompt=shared + [2] * 8)
    sched.add(b)
    plan = step(sched)
    assert (plan.scheduled[0].start, plan.num_new_tokens) == (32, {"b": 8})
    assert b.num_cached_tokens == 32
    assert plan.block_copies == []                       # b's hit ends on a block boundary
    c = make_request("c", 32, prompt=shared)             # a full hit: the last token recomputed,
    sched.add(c)                                         # the 15 before it copied
    plan = step(sched)
    assert plan.num_new_tokens["c"] == 1 and c.num_cached_tokens == 31
    [copy] = plan.block_copies
    assert (copy.dst, copy.num_tokens) == (sched.kv.block_table("c")[1], 15)
    assert copy.src not in sched.kv.block_table("c")


def test_requests_arriving_together_compute_a_shared_prefix_once():
    """b and c share a's first 48 tokens: while a computes them (in chunks of the budget),
    they wait; d, whose prompt is its own, starts at once. Once a's blocks are cached, b and
    c start from them and compute only their own tokens."""
    sched = make_scheduler(token_budget=40, num_blocks=64, block_size=16)
    shared = list(range(500, 548))
    for name, tail in (("a", 1), ("b", 2), ("c", 3)):
        sched.add(make_request(name, 56, prompt=shared + [tail] * 8))
    sched.add(make_request("d", 10))
    assert step(sched).num_new_tokens == {"a": 40}        # b and c wait on a's blocks
    assert step(sched).num_new_tokens == {"a": 16, "d": 10}   # d's own prompt: no wait
    plan = step(sched)                                    # a's 48 shared tokens are cached
    assert plan.num_new_tokens == {"a": 1, "d": 1, "b": 8, "c": 8}
    assert [sched.requests[r].num_cached_tokens for r in "bc"] == [48, 48]


def test_a_request_never_waits_on_a_prefix_no_running_request_computes():
    """The wait is only for blocks a running prompt is computing: with a's prompt done (and
    cached), or with the prefix cache off, b starts in the step it arrives."""
    for caching in (True, False):
        sched = make_scheduler(token_budget=64, caching=caching)
        shared = list(range(500, 548))
        sched.add(make_request("a", 56, prompt=shared + [1] * 8, max_tokens=4))
        step(sched)
        sched.add(make_request("b", 56, prompt=shared + [2] * 8))
        assert "b" in step(sched).num_new_tokens


def test_priority_orders_the_queue():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("low", 4, max_tokens=2, priority=5))
    sched.add(make_request("high", 4, max_tokens=2, priority=0))
    sched.add(make_request("mid", 4, max_tokens=2, priority=1))
    assert run_to_end(sched) == ["high", "mid", "low"]


def test_a_higher_priority_arrival_takes_a_seat():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("low", 4, max_tokens=6, priority=3))
    step(sched)
    sched.add(make_request("high", 4, max_tokens=3, priority=0))
    plan = step(sched)
    low = sched.requests["low"]
    assert plan.num_new_tokens == {"high": 4}
    assert low.status is RequestStatus.PREEMPTED and low.priority == 3
    assert run_to_end(sched) == ["high", "low"]
    assert len(low.output_token_ids) == 6


def test_a_higher_priority_arrival_takes_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8)
    sched.add(make_request("low", 12, max_tokens=4, priority=2))   # 3 blocks, then a 4th
    step(sched)
    sched.add(make_request("high", 8, max_tokens=2, priority=0))   # needs 2 blocks
    plan = step(sched)
    assert "high" in plan.num_new_tokens and "low" not in plan.num_new_tokens
    assert sched.requests["low"].status is RequestStatus.PREEMPTED
    assert run_to_end(sched) == ["high", "low"]


def test_equal_priority_never_preempts_for_a_seat():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("first", 4, max_tokens=4))
    step(sched)
    sched.add(make_request("second", 4, max_tokens=4))
    assert step(sched).num_new_tokens == {"first": 1}
    assert sched.num_preemptions == 0


def test_preempted_requests_resume_before_later_arrivals_of_their_priority():
    sched = make_scheduler(max_num_seqs=2)
    sched.add(make_request("a", 4, max_tokens=8, priority=1))
    sched.add(make_request("b", 4, max_tokens=8, priority=1))
    step(sched)
    sched.add(make_request("vip", 4, max_tokens=2, priority=0))
    sched.add(make_request("late", 4, max_tokens=2, priority=1))
    plan = step(sched)
    assert set(plan.num_new_tokens) == {"a", "vip"}       # b (ranked after a) gave its seat
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED
    order = run_to_end(sched)
    assert order.index("b") < order.index("late")


def test_fair_share_lets_a_second_user_in_past_a_flood():
    def admitted(fair: bool) -> set[str]:
        sched = make_scheduler(max_num_seqs=2, fair_share=fair)
        for i in range(5):
            sched.add(make_request(f"A{i}", 4, max_tokens=20, user="A"))
        sched.add(make_request("B0", 4, max_tokens=20, user="B"))
        return set(step(sched).num_new_tokens)
    assert admitted(False) == {"A0", "A1"}
    assert admitted(True) == {"A0", "B0"}


def test_fair_share_finishes_everyone():
    sched = make_scheduler(max_num_seqs=2, fair_share=True)
    for i in range(6):
        sched.add(make_request(f"A{i}", 4, max_tokens=3, user="A"))
    for i in range(2):
        sched.add(make_request(f"B{i}", 4, max_tokens=3, user="B"))
    order = run_to_end(sched)
    assert sorted(order) == sorted([f"A{i}" for i in range(6)] + ["B0", "B1"])
    assert order.index("B1") < order.index("A3")
