"""Disaggregated serving in the scheduler: a prompt's blocks kept for another replica, and a
request admitted with another replica's KV (LOADING), driven with fake runner results and a
fake copier. The reference is the block pool itself: every block is back once all ends."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.kv.prefix_cache import extend_keys, prompt_block_keys
from ember.request import FinishReason, Request, RequestStatus, SamplingParams
from tests.unit.test_scheduler import EOS, make_request, make_scheduler, step


def remote_request(request_id: str, prompt: list[int], first_token: int = 7,
                   max_tokens: int = 8) -> Request:
    """A decode replica's request: the prompt's KV comes from elsewhere, the first token
    was sampled there."""
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens),
                      frozenset({EOS}), max_tokens, output_token_ids=[first_token])
    request.num_external_tokens = len(prompt)
    return request


def test_kept_blocks_outlive_the_request_until_released():
    """A keep_blocks request that ends by its length hands its blocks over: none is free
    until they are released, and they are cached for the next prompt meanwhile."""
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("p", num_prompt_tokens=10, max_tokens=1)
    request.keep_blocks = True
    sched.add(request)
    step(sched)
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH
    ((kept_request, blocks),) = sched.take_kept()
    assert kept_request is request and len(blocks) == 3
    assert sched.kv.num_free_blocks == 8 - 3
    assert all(sched.kv.pool.ref_count(b) == 1 for b in blocks)
    assert sched.kv.pool.num_cached_blocks == 3   # two full blocks and the tail
    sched.kv.release_blocks(blocks)
    assert sched.kv.num_free_blocks == 8


def test_kept_request_stopped_by_eos_frees_its_blocks():
    """Only a prompt that goes on elsewhere keeps its blocks: one whose first token ends it
    frees them as any request does."""
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("p", num_prompt_tokens=10, max_tokens=1)
    request.keep_blocks = True
    sched.add(request)
    step(sched, token=EOS)
    assert request.finish_reason is FinishReason.STOP
    assert sched.take_kept() == [] and sched.kv.num_free_blocks == 8


def test_loading_request_decodes_from_its_first_token_once_loaded():
    """Admitted: blocks for the whole prompt, LOADING, nothing computed this step; loaded:
    it computes only its first token's KV and samples the second."""
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = remote_request("d", list(range(100, 110)))
    sched.add(request)
    plan = step(sched)
    assert plan.scheduled == [] and request.status is RequestStatus.LOADING
    (load,) = sched.take_loads()
    assert load.first_block == 0 and len(load.block_ids) == 3
    assert load.block_ids == sched.kv.block_table("d")
    sched.end_load("d", loaded=True)
    plan = step(sched, token=9)
    assert plan.num_new_tokens == {"d": 1} and plan.scheduled[0].start == 10
    assert request.output_token_ids == [7, 9]
    assert sched.kv.pool.num_cached_blocks == 2   # the loaded full blocks, for the next one


def test_a_second_request_skips_the_blocks_the_first_loaded():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))
    first = remote_request("a", prompt)
    sched.add(first)
    step(sched)
    sched.take_loads()
    sched.end_load("a", loaded=True)
    second = remote_request("b", prompt + [5, 6])
    sched.add(second)
    step(sched)
    (load,) = sched.take_loads()
    assert load.first_block == 2    # both full blocks of the shared prefix were cached
    assert load.block_ids[:2] == sched.kv.block_table("a")[:2]
    assert second.num_cached_tokens == 8


def test_failed_load_computes_the_prompt_itself():
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = remote_request("d", list(range(100, 110)))
    sched.add(request)
    step(sched)
    sched.take_loads()
    sched.end_load("d", loaded=False)
    plan = step(sched, token=9)
    assert plan.num_new_tokens == {"d": 11}   # the prompt and the first token
    assert request.output_token_ids == [7, 9]


def test_abort_while_loading_keeps_the_blocks_until_the_copy_ends():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add(remote_request("d", list(range(100, 110))))
    step(sched)
    (load,) = sched.take_loads()
    sched.finish("d", FinishReason.ABORT)
    assert sched.has_unfinished()
    # a newcomer cannot be given a block the copy still writes
    sched.add(make_request("x", num_prompt_tokens=20, max_tokens=1))
    step(sched)
    assert not set(sched.kv.block_table("x")) & set(load.block_ids)
    assert all(sched.kv.pool.ref_count(b) == 1 for b in load.block_ids)
    sched.end_load("d", loaded=True)
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()


def test_prompt_block_keys_cover_the_tail():
    prompt = list(range(10))
    keys = prompt_block_keys(prompt, 4, "salt")
    assert keys[:2] == extend_keys([], prompt, 4, "salt") and len(keys) == 3
    assert prompt_block_keys(prompt[:9] + [99], 4, "salt")[2] != keys[2]
    assert prompt_block_keys(prompt[:3], 4) != prompt_block_keys(prompt[:3], 4, "salt")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_aborts_and_failed_copies_leave_every_block_free(seed):
    """Requests loading, decoding, and kept for another replica, with aborts at random
    moments, copies that fail or succeed in random order, and kept blocks released at
    random: once everything ends, every block is free and none was freed twice (the pool
    raises on that)."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=24, block_size=4, token_budget=32)
    pending: list[str] = []             # loads started, not ended
    kept: list[list[int]] = []
    prompts = [list(range(100, 100 + n)) for n in (5, 9, 13)]
    for i in range(12):
        kind = rng.choice(("load", "keep", "plain"))
        prompt = rng.choice(prompts) + [i]
        if kind == "load":
            sched.add(remote_request(f"r{i}", prompt, max_tokens=rng.randint(2, 5)))
        else:
            request = make_request(f"r{i}", len(prompt), prompt=prompt,
                                   max_tokens=1 if kind == "keep" else rng.randint(1, 4))
            request.keep_blocks = kind == "keep"
            sched.add(request)
        for _ in range(rng.randint(0, 3)):
            _random_moment(rng, sched, pending, kept)
    while sched.has_unfinished() or pending or kept:
        _random_moment(rng, sched, pending, kept)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def _random_moment(rng: random.Random, sched, pending: list[str], kept: list[list[int]]
                   ) -> None:
    step(sched, token=rng.choice((7, 7, 7, EOS)))
    pending += [load.request_id for load in sched.take_loads()]
    kept += [blocks for _, blocks in sched.take_kept()]
    if sched.requests and rng.random() < 0.2:
        sched.finish(rng.choice(sorted(sched.requests)), FinishReason.ABORT)
    if pending and rng.random() < 0.5:
        sched.end_load(pending.pop(rng.randrange(len(pending))), loaded=rng.random() < 0.5)
    if kept and rng.random() < 0.5:
        sched.kv.release_blocks(kept.pop(rng.randrange(len(kept))))


def test_a_prompt_wholly_cached_here_copies_nothing():
    """A prompt of whole blocks that this replica holds already decodes at once; its load
    is still reported (the other replica's pin is to be released), with nothing to copy."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 108))
    sched.add(remote_request("a", prompt))
    step(sched)
    sched.take_loads()
    sched.end_load("a", loaded=True)
    second = remote_request("b", prompt)
    sched.add(second)
    step(sched)
    (load,) = sched.take_loads()
    assert load.first_block == len(load.block_ids) == 2
    assert second.status is RequestStatus.RUNNING and second.num_computed_tokens == 8
