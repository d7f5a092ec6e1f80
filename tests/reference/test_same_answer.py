"""Same request, same answer: on the default path (int4 weights, int8 KV cache, the compiled
kernels) a request's greedy tokens and logprobs, and its seeded samples, are bit-identical
whatever happens around it: a cold or warm prefix cache, any chunk size, preemption,
speculation, other requests' prompts in its steps, and up to 8 decoding requests (with
`deterministic`, any number).

Reference: each request run alone, with the prefix cache off, in one step per prompt.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember import LLM, SamplingParams
from ember.engine.core import EngineCore
from ember.request import Request
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow
IDS = itertools.count()

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX_TOKENS,
                        ignore_eos=True, logprobs=2)


def engine_answer(request: Request) -> tuple[list[int], list]:
    """answer() of a finished engine request."""
    return request.output_token_ids, [(lp.logprob, list(lp.top))
                                      for lp in request.output_logprobs]


@pytest.fixture(scope="module")
def prompts(smollm_chat) -> list[list[int]]:
    chats = [smollm_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]
    # a prompt that extends another (a partial-block hit) and one of odd ids
    return chats + [chats[0] + chats[1][5:], list(range(500, 537))]


@pytest.fixture(scope="module")
def alone(smollm_path, prompts) -> dict[tuple[int, str], tuple]:
    """Each prompt alone, cache off, its whole prompt in one step: greedy and seeded."""
    engine = LLM(str(smollm_path), enable_prefix_caching=False).engine
    out = {}
    for i, prompt in enumerate(prompts):
        for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            request = engine.add_request(f"alone-{i}-{kind}", prompt, params)
            while not request.is_finished:
                engine.step()
            out[i, kind] = engine_answer(request)
    return out


def test_a_repeated_request_gets_the_same_answer_from_a_warm_cache(smollm_path, prompts, alone):
    """Sent 3 times in a row (the later ones hit the cache: every block but the last token's,
    or a partial block), each prompt answers as alone with the cache off."""
    llm = LLM(str(smollm_path))
    for i, prompt in enumerate(prompts):
        for _ in range(3):
            request = llm.engine.add_request(f"again-{i}-{_}", prompt, GREEDY)
            while not request.is_finished:
                llm.engine.step()
            assert engine_answer(request) == alone[i, "greedy"], i
    assert llm.engine.scheduler.kv.num_hit_tokens > 0


HEAVY = pytest.mark.heavy   # 7-token chunks and self-drafts take hundreds of steps


@pytest.mark.parametrize("options", [
    pytest.param(dict(max_num_batched_tokens=7, max_num_seqs=8), marks=HEAVY),
    dict(max_num_batched_tokens=64, max_num_seqs=3),
    pytest.param(dict(speculative="ngram", max_num_seqs=2), marks=HEAVY),
    dict(speculative="self", max_num_seqs=1),
    pytest.param(dict(max_num_batched_tokens=7, deterministic=True), marks=HEAVY),
    # preemption and recompute (room for the 256-token calibration prompt, not every request)
    dict(num_blocks=33, block_size=8, deterministic=True),
    pytest.param(dict(speculative="ngram", deterministic=True), marks=HEAVY),
    pytest.param(dict(speculative="self", deterministic=True), marks=HEAVY),
], ids=["chunk7-seqs8", "chunk64-seqs3", "ngram-seqs2", "self-seqs1", "chunk7-deterministic",
        "preempt-deterministic", "ngram-deterministic", "self-deterministic"])
def test_batched_chunked_preempted_and_speculative_answers_equal_alone(smollm_path, prompts,
                                                                       alone, options):
    """Every prompt at once, greedy and seeded, twice (the second round over a warm cache);
    by default up to 8 decode rows a step (a step verifying drafts has up to 5 a request),
    with deterministic any number."""
    engine = LLM(str(smollm_path), **options).engine
    for round_ in range(2):
        requests = {(i, kind): engine.add_request(f"{round_}-{i}-{kind}", prompt, params)
                    for i, prompt in enumerate(prompts)
                    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED))}
        while engine.has_unfinished():
            engine.step()
        for key, request in requests.items():
            assert engine_answer(request) == alone[key], key
    if "num_blocks" in options:
        assert engine.scheduler.num_preemptions > 0, "the test must preempt"


@pytest.fixture(scope="module")
def engines(smollm_path) -> dict[int, EngineCore]:
    """Engines by step budget, made on first use (each one's cache persists across examples:
    the cache state is whatever earlier examples left)."""
    return {}


def engine_for(engines: dict[int, EngineCore], path, budget: int) -> EngineCore:
    if budget not in engines:
        engines[budget] = LLM(str(path), max_num_batched_tokens=budget).engine
    return engines[budget]


HEALTH = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=4, derandomize=True, **HEALTH)
@given(data=st.data())
def test_random_arrivals_chunks_and_cache_states_never_change_an_answer(smollm_path, prompts,
                                                                        alone, engines, data):
    """Random requests (greedy or seeded, from the prompts), arriving at random steps, in a
    random step budget, over whatever the cache holds: each answers as alone, cache off (by
    default: at most 6 requests, so at most 6 decode rows a step)."""
    check_random_traffic(smollm_path, prompts, alone, engines, data)


@pytest.mark.fuzz
@settings(max_examples=60, **HEALTH)
@given(data=st.data())
def test_many_random_arrivals_never_change_an_answer(smollm_path, prompts, alone, engines,
                                                     data):
    """The same, larger and not derandomized (opt-in: -m fuzz)."""
    check_random_traffic(smollm_path, prompts, alone, engines, data)


def check_random_traffic(smollm_path, prompts, alone, engines, data) -> None:
    """Draw a step budget and requests (prompt, seeded or greedy, arrival step), run them on
    that budget's engine and compare each with the request alone, cache off."""
    budget = data.draw(st.sampled_from([5, 16, 48, 2048]), label="budget")
    engine = engine_for(engines, smollm_path, budget)
    picks = data.draw(st.lists(st.tuples(st.integers(0, len(prompts) - 1), st.booleans(),
                                         st.integers(0, 6)), min_size=2, max_size=6),
                      label="requests (prompt, seeded, arrival step)")
    pending = sorted(enumerate(picks), key=lambda x: x[1][2])
    requests: list[tuple[Request, tuple[int, str]]] = []
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            n, (i, seeded, _) = pending.pop(0)
            kind = "seeded" if seeded else "greedy"
            request = engine.add_request(f"p{next(IDS)}", prompts[i],
                                         SEEDED if seeded else GREEDY)
            requests.append((request, (i, kind)))
        engine.step()
        step += 1
    for request, key in requests:
        assert engine_answer(request) == alone[key], key
