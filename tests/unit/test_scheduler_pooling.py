"""Embedding requests in the token-budget loop, driven with fake runner results: they are
prefilled in chunks beside generation, never sampled, and end with the vector the runner
pools; an encoder's prompts are never split across steps."""
from __future__ import annotations

from ember.config import SchedulerConfig
from ember.kv.kv_manager import KVCacheManager
from ember.request import FinishReason, PoolingParams, Request, SamplingParams
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler
from tests.unit.test_scheduler import make_request, make_scheduler


def embedding(request_id: str, num_tokens: int, base: int = 5000) -> Request:
    return Request(request_id, list(range(base, base + num_tokens)), SamplingParams(),
                   frozenset(), max_tokens=0, pooling=PoolingParams("mean"))


def fake_result(plan: SchedulerOutput) -> RunnerOutput:
    """A token for each sampling request, a vector for each embedding whose prompt is done."""
    out = RunnerOutput()
    for item in plan.scheduled:
        if item.samples:
            out.sampled_token_ids[item.request.request_id] = [7]
        elif item.request.pooling is not None and item.end == item.request.num_prompt_tokens:
            out.pooled[item.request.request_id] = [0.6, 0.8]
    return out


def test_an_embedding_is_chunked_beside_generation_and_ends_with_its_vector():
    sched = make_scheduler(token_budget=32, num_blocks=32)
    sched.add(make_request("gen", num_prompt_tokens=4, max_tokens=10))
    emb = embedding("emb", 50)
    sched.add(emb)
    plans, finished_in = [], None
    while sched.has_unfinished():
        plan = sched.schedule()
        assert not any(s.samples for s in plan.scheduled if s.request.pooling is not None)
        plans.append(plan.num_new_tokens)
        advanced = sched.update(plan, fake_result(plan))
        if emb in advanced:
            finished_in = len(plans)
    assert plans[0] == {"gen": 4, "emb": 28}        # one budget, shared
    assert plans[1] == {"gen": 1, "emb": 22}        # the rest, beside the decode
    assert finished_in == 2
    assert emb.embedding == [0.6, 0.8] and emb.output_token_ids == []
    assert emb.finish_reason is FinishReason.STOP
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_whole_prompts_wait_for_a_step_with_room():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), KVCacheManager(16, 16, False),
                      max_model_len=32, whole_prompts=True)
    for name, n in (("a", 20), ("b", 20), ("c", 10)):
        sched.add(embedding(name, n))
    plans = []
    while sched.has_unfinished():
        plan = sched.schedule()
        plans.append(plan.num_new_tokens)
        sched.update(plan, fake_result(plan))
    assert plans == [{"a": 20}, {"b": 20, "c": 10}]
