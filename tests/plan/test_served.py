"""What serving adds to a step: which served step intervals count (reference: intervals
worked by hand), and, on the tiny model, a real server's steps measured end to end."""
from __future__ import annotations

import pytest

from ember.config import EngineConfig, ServerConfig
from ember.engine.core import EngineCore
from ember.plan.served import CONCURRENCIES, ServedStep, measure_served, step_intervals
from ember.plan.stepmodel import StepModel, StepShape
from ember.server.serve import serve_in_thread
from tests.server.conftest import TEST_KV_GIB


def served(began: float, *request_ids: str) -> ServedStep:
    n = len(request_ids)
    return ServedStep(began, StepShape(decode_rows=n, decode_keys=100 * n), n,
                      frozenset(request_ids))


def test_only_steps_followed_at_once_give_an_interval():
    """a runs alone, ends; the engine waits for b (no interval across the wait); c joins b,
    b ends, c runs on. Each step that shares a request with the next gives its interval."""
    steps = [served(0.000, "a"), served(0.010, "a"), served(0.050, "b"),
             served(0.058, "b", "c"), served(0.069, "c")]
    got = step_intervals(steps)
    assert [k for k, _ in got] == [0, 2, 3]
    assert [t for _, t in got] == pytest.approx([0.010, 0.008, 0.011])


@pytest.mark.slow
@pytest.mark.heavy   # a dozen client processes and a gateway
def test_serving_the_engine_measures_its_step_intervals(tiny_llama_dir):
    """The tiny model served by the real app, a bench client streaming each concurrency
    straight to it and through `ember route`: every run's steps are timed, and against a
    step model that predicts nothing the whole interval is overhead, which the fit then
    explains better than the model alone."""
    folder, _ = tiny_llama_dir
    core = EngineCore(EngineConfig.from_options(model=str(folder), kv_cache_gib=TEST_KV_GIB,
                                                dtype="float32", max_model_len=512))
    direct, relayed = measure_served(
        core, StepModel((0.0,) * 7),
        lambda engine: serve_in_thread(engine, ServerConfig(port=0)), through_gateway=True)
    assert direct.measured and direct.per_step_s + direct.per_token_s > 0
    for overhead in (direct, relayed):
        assert overhead.measured
        assert [r["concurrency"] for r in overhead.runs] == list(CONCURRENCIES)
        assert all(r["steps"] > 0 and r["client_chunk_gap_p50_s"] > 0 for r in overhead.runs)
    fit = direct.residuals
    assert fit["without"]["median_abs"] == 1.0
    assert fit["with"]["median_abs"] < 0.5
