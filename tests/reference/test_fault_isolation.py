"""One request's fault fails that request alone.

A fault is injected for one chosen request at each stage of the data path (admission,
scheduling, preparing inputs, sampling, applying results, detokenizing). Reference: the same
prompts run with no fault. The other requests' greedy tokens must equal the reference, the
chosen one must end with RequestFailed, every KV block must be free once idle, and the engine
must still be ready. A fault that fails every step is the engine's own: it dies.
"""
from __future__ import annotations

import asyncio
import functools

import pytest

from ember.config import EngineConfig
from ember.engine import async_engine as async_engine_module
from ember.engine.async_engine import AsyncEngine, EngineState, Finished
from ember.errors import EngineDead, RequestFailed
from ember.request import SamplingParams
from ember.runner import runner as runner_module
from tests.server.conftest import TEST_KV_GIB

PROMPTS = [[1, 5, 9, 13], [2, 6, 10], [3, 7, 11, 15, 19], [4, 8], [5, 9, 14, 20, 21, 22]]
VICTIM = 2  # the prompt whose request the fault hits
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    engine = AsyncEngine(EngineConfig.from_options(model=str(folder), dtype="float32",
                                                   kv_cache_gib=TEST_KV_GIB))
    engine.start()
    asyncio.run(engine.wait_ready())
    yield engine
    engine.shutdown()


async def _one(engine: AsyncEngine, request_id: str, prompt: list[int],
               params: SamplingParams) -> list[int] | BaseException:
    tokens: list[int] = []
    try:
        async for item in engine.generate(request_id, prompt, params):
            if not isinstance(item, Finished):
                tokens += item.token_ids
    except (RequestFailed, EngineDead) as e:
        return e
    return tokens


def run_all(engine: AsyncEngine, tag: str, params: SamplingParams = PARAMS
            ) -> list[list[int] | BaseException]:
    async def main():
        return await asyncio.gather(*[_one(engine, f"{tag}{i}", p, params)
                                      for i, p in enumerate(PROMPTS)])
    return asyncio.run(main())


def victim_in(request_ids) -> bool:
    return any(r.startswith(f"{_tag[0]}{VICTIM}-") for r in request_ids)


_tag = [""]  # the running test's request-id prefix (read by the fault predicates)


def _ids_of(value) -> list[str]:
    """Request ids found in a fault site's argument (a request, a plan, or a list)."""
    if hasattr(value, "scheduled"):
        return [s.request.request_id for s in value.scheduled]
    if isinstance(value, list):
        return [getattr(r, "request_id", "") for r in value]
    return [getattr(value, "request_id", "")]


def raising_for_victim(fn, arg_index: int):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if victim_in(_ids_of(args[arg_index])):
            raise Injected("injected fault")
        return fn(*args, **kwargs)
    return wrapper


def inject(stage: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    core = engine.core
    if stage == "admit":
        def add_request(request_id, *args, **kwargs):
            if victim_in([request_id]):
                raise Injected("injected fault")
            return real_add(request_id, *args, **kwargs)
        real_add = core.add_request
        monkeypatch.setattr(core, "add_request", add_request)
    elif stage == "schedule":
        kv = core.scheduler.kv
        monkeypatch.setattr(kv, "allocate_slots", raising_for_victim(kv.allocate_slots, 0))
    elif stage == "prepare":
        monkeypatch.setattr(runner_module, "prepare_inputs",
                            raising_for_victim(runner_module.prepare_inputs, 0))
    elif stage == "sample":
        sampler = core.runner.sampler
        monkeypatch.setattr(sampler, "sample", raising_for_victim(sampler.sample, 1))
    elif stage == "update":
        scheduler = core.scheduler
        monkeypatch.setattr(scheduler, "_stop_reason",
                            raising_for_victim(scheduler._stop_reason, 0))
    elif stage == "detokenize":
        real_update = async_engine_module.SequenceText.update

        def update(self):
            if victim_in([self.request.request_id]):
                raise Injected("injected fault")
            return real_update(self)
        monkeypatch.setattr(async_engine_module.SequenceText, "update", update)


def assert_idle_and_ready(engine: AsyncEngine) -> None:
    kv = engine.core.scheduler.kv
    assert not engine.core.scheduler.requests
    assert kv.num_free_blocks == kv.num_blocks
    assert engine.state is EngineState.READY and engine.ready


@pytest.mark.parametrize("stage", ["admit", "schedule", "prepare", "sample", "update",
                                   "detokenize"])
def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch, stage):
    _tag[0] = f"ref-{stage}-"
    reference = run_all(engine, _tag[0])
    assert all(isinstance(r, list) and len(r) == PARAMS.max_tokens for r in reference)
    failed_before = engine.num_failed_requests
    with monkeypatch.context() as patch:
        inject(stage, engine, patch)
        _tag[0] = f"fault-{stage}-"
        got = run_all(engine, _tag[0])
    assert isinstance(got[VICTIM], RequestFailed), got[VICTIM]
    assert "Injected" in got[VICTIM].message
    for i, (want, have) in enumerate(zip(reference, got)):
        if i != VICTIM:
            assert have == want, f"prompt {i} changed under another request's fault"
    assert engine.num_failed_requests == failed_before + 1
    assert_idle_and_ready(engine)
    _tag[0] = f"after-{stage}-"
    assert run_all(engine, _tag[0]) == reference  # still serving, the same tokens


def test_a_fault_in_every_step_kills_the_engine(tiny_llama_dir, monkeypatch):
    folder, _ = tiny_llama_dir
    engine = AsyncEngine(EngineConfig.from_options(model=str(folder), dtype="float32",
                                                   kv_cache_gib=TEST_KV_GIB))
    engine.start()
    asyncio.run(engine.wait_ready())
    try:
        def broken(*args, **kwargs):
            raise Injected("the forward is broken")
        monkeypatch.setattr(engine.core.runner, "forward", broken)
        _tag[0] = "dead-"
        results = run_all(engine, _tag[0])
        assert all(isinstance(r, (RequestFailed, EngineDead)) for r in results)
        assert any(isinstance(r, EngineDead) for r in results)
        assert engine.state is EngineState.DEAD and not engine.ready
    finally:
        engine.shutdown()
