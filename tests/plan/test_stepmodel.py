"""The step-time model: its features from real scheduler plans (reference: the positions the
scheduler planned, summed by hand), and the fit, which must recover coefficients that made
synthetic measurements."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from ember.config import SchedulerConfig
from ember.kv.kv_manager import KVCacheManager
from ember.plan.stepmodel import (FEATURES, ServingOverhead, StepModel, StepShape, StepSpread,
                                  fit, fit_overhead, residuals, step_shape)
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
    for name in ("prompt_forward", "prompt_rows", "decode_forward", "decode_rows_to_8"):
        j = FEATURES.index(name)
        assert model.coefficients[j] == pytest.approx(TRUE[j], rel=0.1), name
    unseen = [StepShape(300, 300 * 301 // 2 + 300 * 800, 6, 6 * 700), StepShape(0, 0, 20, 20_000)]
    for shape in unseen:
        assert model.predict(shape) == pytest.approx(truth.predict(shape), rel=0.05)


def test_rows_past_8_are_fitted_at_their_own_slope():
    """A decode row past 8 costs a third of one before (the int8 matrix product): the fit
    finds both slopes, where one slope for every row would overestimate a batch of 32 by a
    third."""
    shapes = grid()
    truth = StepModel(TRUE)
    model = fit(shapes, [truth.predict(s) for s in shapes])
    rows_to_8, rows_past_8 = (model.coefficients[FEATURES.index(name)]
                              for name in ("decode_rows_to_8", "decode_rows_past_8"))
    assert rows_past_8 == pytest.approx(rows_to_8 / 3, rel=1e-6)
    step = {b: model.predict(StepShape(decode_rows=b, decode_keys=b * 65)) for b in (8, 9, 32)}
    assert step[9] - step[8] == pytest.approx(TRUE[5] + 65 * TRUE[6], rel=1e-6)
    assert step[32] == pytest.approx(TRUE[3] + 8 * TRUE[4] + 24 * TRUE[5] + 32 * 65 * TRUE[6])


def test_a_profile_of_the_earlier_format_predicts_as_it_did():
    """Earlier profiles stored one slope for every decode row and an extra one past 8."""
    old = {"features": ["prompt_forward", "prompt_rows", "prompt_keys", "decode_forward",
                        "decode_rows", "decode_rows_past_8", "decode_keys"],
           "coefficients": [4e-3, 1.2e-4, 2e-9, 3e-3, 6e-4, 1e-4, 2e-7], "min_step_s": 0.0}
    model = StepModel.from_json(old)
    for rows in (1, 8, 9, 40):
        shape = StepShape(decode_rows=rows, decode_keys=rows * 100)
        by_hand = 3e-3 + 6e-4 * rows + 1e-4 * max(0, rows - 8) + 2e-7 * rows * 100
        assert model.predict(shape) == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(ValueError, match="measure again"):
        StepModel.from_json(old | {"features": old["features"][:-1] + ["keys"]})


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
    assert model.predict(decode) == pytest.approx(3e-3 + 8 * 6e-4 + 2 * 2e-4 + 1000 * 2e-7)
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


# a served step: 0.8 ms more a step, 0.15 ms more a streamed token
PER_STEP, PER_TOKEN = 0.8e-3, 0.15e-3


def served_steps() -> tuple[list[StepShape], list[int]]:
    """Steps such as served runs give (decode batches of 1 to 16 at growing contexts, and
    the prompt steps that start them), with the tokens each streams (every decode row one;
    a prompt step its requests' first)."""
    shapes, tokens = [], []
    for b in (1, 2, 4, 8, 16):
        shapes.append(StepShape(64 * b, b * _keys(0, 64)))
        tokens.append(b)
        for c in range(64, 96):
            shapes.append(StepShape(decode_rows=b, decode_keys=b * (c + 1)))
            tokens.append(b)
    return shapes, tokens


def test_fit_overhead_recovers_the_overhead_that_made_the_intervals():
    shapes, tokens = served_steps()
    truth = StepModel(TRUE)
    seconds = [truth.predict(s) + PER_STEP + PER_TOKEN * n for s, n in zip(shapes, tokens)]
    got = fit_overhead(truth, shapes, tokens, seconds)
    assert (got.per_step_s, got.per_token_s) == pytest.approx((PER_STEP, PER_TOKEN), rel=1e-6)
    assert got.measured and got.residuals["with"]["p90_abs"] < 1e-6
    assert got.residuals["without"]["mean"] < -0.05   # the step model alone is short


def test_fit_overhead_under_noise_and_disturbed_intervals():
    """±5% noise on every interval and one in ten 3x too long (other work had the cores):
    with interference=1.5 both terms come back within 15%, and the served prediction is
    closer to the intervals than the in-process one."""
    rng = random.Random(11)
    shapes, tokens = served_steps()
    shapes, tokens = shapes * 3, tokens * 3
    truth = StepModel(TRUE)
    seconds = [(truth.predict(s) + PER_STEP + PER_TOKEN * n) * (1 + rng.uniform(-0.05, 0.05))
               * (3.0 if i % 10 == 0 else 1.0) for i, (s, n) in enumerate(zip(shapes, tokens))]
    got = fit_overhead(truth, shapes, tokens, seconds, interference=1.5)
    assert got.per_step_s == pytest.approx(PER_STEP, rel=0.15)
    assert got.per_token_s == pytest.approx(PER_TOKEN, rel=0.15)
    assert got.residuals["with"]["left_out"] == len(range(0, len(shapes), 10))
    assert got.residuals["with"]["median_abs"] < got.residuals["without"]["median_abs"]
    # the spread keeps the disturbed intervals: its top tenth is theirs, about 3x
    assert got.spread[50] == pytest.approx(1.0, abs=0.03)
    assert got.spread[85] < 1.1 and got.spread[95] == pytest.approx(3.0, rel=0.1)


def test_the_spread_is_the_intervals_scatter_around_the_served_prediction():
    """Intervals of the served prediction times factors 0.6, 0.7, ... 1.6 in turn: the
    spread is the percentiles of interval / prediction with the fitted overhead, over every
    interval, so its ends are the factors' ends over the fit's typical factor."""
    shapes, tokens = served_steps()
    shapes, tokens = shapes * 4, tokens * 4
    truth = StepModel(TRUE)
    factors = [0.6 + 0.1 * (i % 11) for i in range(len(shapes))]
    seconds = [(truth.predict(s) + PER_STEP + PER_TOKEN * n) * f
               for s, n, f in zip(shapes, tokens, factors)]
    got = fit_overhead(truth, shapes, tokens, seconds, interference=1.5)
    ratios = sorted(y / (truth.predict(s) + got.seconds(n))
                    for s, n, y in zip(shapes, tokens, seconds))
    assert len(got.spread) == 101 and list(got.spread) == sorted(got.spread)
    assert got.spread[0] == pytest.approx(ratios[0], abs=1e-4)
    assert got.spread[100] == pytest.approx(ratios[-1], abs=1e-4)   # kept or left out
    assert got.spread[100] / got.spread[0] > 2.0   # the scatter is kept, not averaged away


def test_step_factors_follow_the_spread_with_a_median_of_one():
    """Draws from a spread rising from 1 to its median 2, to 4 at the 90th percentile and 10
    at the top: factors from 0.5 to 5, a median of 1 and 1.75 at the 80th percentile."""
    spread = [1.0 + q / 50 if q <= 50 else 2.0 + (q - 50) / 20 if q <= 90 else
              4.0 + (q - 90) * 0.6 for q in range(101)]
    factors = sorted(StepSpread(spread, seed=1).factors)
    n = len(factors)
    assert factors[0] >= 0.5 and factors[-1] <= 5.0
    assert factors[n // 2] == pytest.approx(1.0, rel=0.03)
    assert factors[int(n * 0.8)] == pytest.approx(1.75, rel=0.03)
    assert StepSpread(spread, seed=1).factors == StepSpread(spread, seed=1).factors
    assert StepSpread(spread, seed=2).factors != StepSpread(spread, seed=1).factors
    assert StepSpread(spread, seed=1).factor(3) == StepSpread(spread, seed=1).factor(3 + 4096)


def test_an_overhead_never_comes_out_negative():
    """Served steps as fast as in-process ones except for a fixed cost per step: the token
    term, which noise could make negative, is dropped and the step term refitted; a server
    faster than the engine alone gets no overhead at all."""
    rng = random.Random(5)
    shapes, tokens = served_steps()
    truth = StepModel(TRUE)
    seconds = [(truth.predict(s) + PER_STEP) * (1 + rng.uniform(-0.02, 0.02)) for s in shapes]
    got = fit_overhead(truth, shapes, tokens, seconds)
    assert got.per_token_s >= 0 and got.per_step_s > 0
    assert got.per_step_s + got.per_token_s * 4 == pytest.approx(PER_STEP, rel=0.2)
    faster = fit_overhead(truth, shapes, tokens, [0.9 * truth.predict(s) for s in shapes])
    assert (faster.per_step_s, faster.per_token_s) == (0.0, 0.0)


def test_a_serving_overhead_adds_per_step_and_per_token():
    overhead = ServingOverhead(1e-3, 2e-4, measured=True)
    assert overhead.seconds(0) == 1e-3 and overhead.seconds(5) == pytest.approx(2e-3)
    assert ServingOverhead.from_json(overhead.to_json()) == overhead
    assert ServingOverhead().seconds(64) == 0.0
    both = overhead.plus(ServingOverhead(0.5e-3, 1e-4, measured=True))
    assert both.seconds(5) == pytest.approx(overhead.seconds(5) + 0.5e-3 + 5e-4)
    spread = replace(overhead, spread=(0.8, 1.0, 1.6))
    assert ServingOverhead.from_json(json.loads(json.dumps(spread.to_json()))) == spread
    relayed = ServingOverhead(0.5e-3, 1e-4, measured=True, spread=(0.7, 1.0, 2.5))
    assert spread.plus(relayed).spread == relayed.spread   # measured with both at work
    assert spread.plus(ServingOverhead()).spread == spread.spread
