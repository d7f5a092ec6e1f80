"""The step-time model: its features from real scheduler plans (reference: the positions the
scheduler planned, summed by hand), and the fit, which must recover coefficients that made
synthetic measurements."""
from __future__ import annotations

import random

import pytest

from ember.config import SchedulerConfig
from ember.kv.kv_manager import KVCacheManager
from ember.plan.stepmodel import FEATURES, StepModel, StepShape, fit, residuals, step_shape
from ember.request import Request, SamplingParams
from ember.scheduler.output import RunnerOutput
from ember.scheduler.scheduler import Scheduler

TRUE = (4e-3, 1.2e-4, 2e-9, 3e-3, 6e-4, 2e-4, 2e-7)


def grid() -> list[StepShape]:
    """Shapes such as a profile measures: lone prompts at several contexts, decode batches
    at several contexts, and decodes beside a prompt chunk."""
    shapes = []
    for n in (16, 64, 128, 256, 512):
        for c in (0, 512, 1536):
            shapes.append(StepShape(n, (c + n) * (c + n + 1) // 2 - c * (c + 1) // 2))
    for b in (1, 2, 4, 8, 12, 16, 32, 64):
        for c in (64, 512, 1024):
            shapes.append(StepShape(decode_rows=b, decode_keys=b * (c + 1)))
    for b in (1, 4, 16):
        shapes.append(StepShape(256, 256 * 257 // 2, b, b * 129))
    return shapes


def test_fit_recovers_the_coefficients_that_made_the_measurements():
    shapes = grid()
    truth = StepModel(TRUE)
    model = fit(shapes, [truth.predict(s) for s in shapes])
    assert model.coefficients == pytest.approx(TRUE, rel=1e-6)
    assert residuals(model, shapes, [truth.predict(s) for s in shapes])["all"]["p90_abs"] \
        < 1e-6


def test_fit_under_noise_predicts_within_the_noise():
    """±3% multiplicative noise: the large terms come back within 10%, and predictions of
    shapes the fit never saw within 5%."""
    rng = random.Random(7)
    shapes = grid() * 3
    truth = StepModel(TRUE)
    seconds = [truth.predict(s) * (1 + rng.uniform(-0.03, 0.03)) for s in shapes]
    model = fit(shapes, seconds)
    for name in ("prompt_forward", "prompt_rows", "decode_forward", "decode_rows"):
        j = FEATURES.index(name)
        assert model.coefficients[j] == pytest.approx(TRUE[j], rel=0.1), name
    unseen = [StepShape(300, 300 * 301 // 2 + 300 * 800, 6, 6 * 700), StepShape(0, 0, 20, 20_000)]
    for shape in unseen:
        assert model.predict(shape) == pytest.approx(truth.predict(shape), rel=0.05)


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted():
    """Decode steps whose time does not grow past 8 rows, with noise: the past-8 term could
    come out negative; it is dropped, so more rows never cost less."""
    rng = random.Random(3)
    true = (4e-3, 1.2e-4, 2e-9, 3e-3, 6e-4, 0.0, 2e-7)
    shapes = grid() * 2
    seconds = [StepModel(true).predict(s) * (1 + rng.uniform(-0.05, 0.05)) for s in shapes]
    model = fit(shapes, seconds)
    assert all(c >= 0 for c in model.coefficients)
    times = [model.predict(StepShape(decode_rows=b, decode_keys=b * 100)) for b in range(1, 65)]
    assert times == sorted(times)


def _scheduler(budget: int, num_blocks: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget,
                                     prefill_tokens_with_decodes=None),
                     KVCacheManager(num_blocks, 16, enable_prefix_caching=caching),
                     max_model_len=4096)


def _request(rid: str, n: int, max_tokens: int) -> Request:
    """A prompt of its own (no prefix shared with another id's)."""
    first = 1000 * (1 + ord(rid[0]) - ord("a"))
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens),
                   frozenset({2}), max_tokens)


def _keys(start: int, end: int) -> int:
    return sum(p + 1 for p in range(start, end))


def test_step_shape_of_the_schedulers_chunks_and_decodes():
    sched = _scheduler(budget=64)
    sched.add(_request("a", 100, 4))
    plan = sched.schedule()
    assert step_shape(plan) == StepShape(64, _keys(0, 64))
    sched.update(plan, RunnerOutput())
    plan = sched.schedule()
    assert step_shape(plan) == StepShape(36, _keys(64, 100))
    sched.update(plan, RunnerOutput({"a": [7]}))
    sched.add(_request("b", 20, 4))
    plan = sched.schedule()   # a decodes its first generated token beside b's whole prompt
    assert step_shape(plan) == StepShape(20, _keys(0, 20), 1, _keys(100, 101))


def test_a_preempted_request_recomputes_its_output_as_decode_rows():
    """Three blocks for two growing requests: the later one is preempted, and when it runs
    again it computes its prompt and its generated tokens in one catch-up: prompt positions
    are prompt rows, generated ones decode rows (as the runner lays them out)."""
    sched = _scheduler(budget=128, num_blocks=3, caching=False)
    sched.add(_request("a", 10, 30))
    b = _request("b", 10, 10)
    sched.add(b)
    for _ in range(100):
        plan = sched.schedule()
        again = [s for s in plan.scheduled if s.request is b and b.num_preemptions]
        if again:
            k = len(b.output_token_ids)
            assert k > 0 and again[0].start == 0 and again[0].num_new_tokens == 10 + k
            assert step_shape(plan) == StepShape(10, _keys(0, 10), k, _keys(10, 10 + k))
            return
        sched.update(plan, RunnerOutput({s.request.request_id: [7] for s in plan.scheduled
                                         if s.samples}))
    pytest.fail("b was never preempted and resumed")


def test_predict_adds_each_forward_that_runs_and_keeps_the_floor():
    model = StepModel(TRUE, min_step_s=0.5e-3)
    prompt, decode = StepShape(100, 5050), StepShape(decode_rows=10, decode_keys=1000)
    both = StepShape(100, 5050, 10, 1000)
    assert model.predict(prompt) == pytest.approx(4e-3 + 100 * 1.2e-4 + 5050 * 2e-9)
    assert model.predict(decode) == pytest.approx(3e-3 + 10 * 6e-4 + 2 * 2e-4 + 1000 * 2e-7)
    assert model.predict(both) == pytest.approx(model.predict(prompt) + model.predict(decode))
    assert StepModel((0.0,) * 7, min_step_s=0.5e-3).predict(decode) == 0.5e-3


def test_steps_disturbed_by_other_work_are_left_out_of_the_refit():
    """One step in eight measured 3x too long (the cores were busy elsewhere): the plain fit
    is pulled up; with interference=1.5 the refit leaves them out and recovers the truth."""
    shapes = grid() * 2
    truth = StepModel(TRUE)
    seconds = [truth.predict(s) * (3.0 if i % 8 == 0 else 1.0) for i, s in enumerate(shapes)]
    plain = fit(shapes, seconds)
    robust = fit(shapes, seconds, interference=1.5)
    assert robust.coefficients == pytest.approx(TRUE, rel=1e-3)
    assert plain.coefficients != pytest.approx(TRUE, rel=0.05)
