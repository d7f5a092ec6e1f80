"""The token-budget loop, driven with fake runner results: no model, no torch."""
from __future__ import annotations

import pytest

from ember.config import SchedulerConfig
from ember.errors import ContextTooLong, InvalidRequest
from ember.kv.kv_manager import KVCacheManager
from ember.request import FinishReason, Request, RequestStatus, SamplingParams
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler

EOS = 2


def make_scheduler(token_budget: int = 64, num_blocks: int = 32, block_size: int = 16,
                   max_num_seqs: int = 8, max_model_len: int = 4096) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=token_budget),
                     KVCacheManager(num_blocks, block_size), max_model_len)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8,
                 **params) -> Request:
    return Request(request_id, list(range(10, 10 + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens, **params), frozenset({EOS}), max_tokens)


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
    assert plan.num_new_tokens == {"b": 9}
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == 4


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
