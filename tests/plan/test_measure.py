"""The profiler's pipeline (served engine, mixes over HTTP, steps recorded start to start)
run against a simulated replica, whose step model is known: the recorded shapes are the
ones the mixes ask of the scheduler, and no step is recorded shorter than the replica's own
price for it. (The real engine's profile: test_plan_cli.py, slow.)"""
from __future__ import annotations

import asyncio

from ember.config import EngineConfig
from ember.engine.async_engine import AsyncEngine
from ember.plan.measure import StepRecorder, _Server
from ember.plan.mixes import Mix, drive
from ember.plan.replica import SimulatedCore
from ember.plan.stepmodel import StepShape
from tests.server.conftest import TEST_KV_GIB


def keys(start: int, end: int) -> int:
    return sum(p + 1 for p in range(start, end))


def test_the_mixes_make_the_shapes_and_the_steps_are_timed_start_to_start(profile):
    recorder = StepRecorder(lambda cfg: SimulatedCore(cfg, profile))
    engine = AsyncEngine(EngineConfig.from_options(model=profile.model_path,
                                                   kv_cache_gib=TEST_KV_GIB),
                         core_factory=recorder.build)
    server = _Server(engine)
    try:
        server.wait_ready(engine)
        recorder.recording = True
        series = [Mix("prompt n64 c512", (576,), 1, cached_prefix=512),
                  Mix("decode b4 c64", (64,) * 4, 6),
                  Mix("mixed b2", (32,) * 2, 12, late_prompt_lens=(300,), late_after=3)]
        asyncio.run(drive(server.url, profile.vocab_size, series, max_seconds=60,
                          say=lambda _: None))
    finally:
        server.close()
    shapes = recorder.shapes
    assert StepShape(64, keys(512, 576)) in shapes            # the prompt past its cached prefix
    # every token the mixes computed is in some recorded step, however the arrivals batched:
    # prompts 513 (the prefix's) + 64, 4 x 64, 2 x 32 + 300; decodes 4 x 5 and 2 x 11
    assert sum(s.prompt_rows for s in shapes) == 513 + 64 + 256 + 64 + 300
    assert sum(s.decode_rows for s in shapes) == 20 + 22
    assert any(s.kind == "mixed" for s in shapes)             # the late prompt beside decodes
    model = profile.step_model
    assert all(t >= model.predict(s) for s, t in zip(shapes, recorder.seconds))
