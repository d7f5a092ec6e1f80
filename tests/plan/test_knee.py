"""The knee `ember route --plan` aims the autoscaler at. Reference: for a step time
d0 + b * B (b = d1 + d3 * context), throughput over latency B / (d0 + b * B)^2 peaks at
B = d0 / b, worked out by hand here."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ember.cli import build_parser
from ember.config import ServerConfig
from ember.plan.knee import knee, profile_knee
from ember.plan.stepmodel import ServingOverhead, StepModel
from ember.router.cli import router_config, target_ongoing
from tests.plan.conftest import make_profile


def decode_model(d0: float, d1: float, d3: float = 0.0, d2: float | None = None
                 ) -> StepModel:
    """d1 a row, and d2 a row past 8 (d1 unless given)."""
    return StepModel((1e-3, 1e-4, 0.0, d0, d1, d1 if d2 is None else d2, d3), 0.0)


@pytest.mark.parametrize("d0, d1, d3, context, expected", [
    (6e-3, 5e-4, 0.0, 512, 12),       # 6 / 0.5
    (6e-3, 5e-4, 1e-6, 500, 6),       # 6 / (0.5 + 0.5)
    (3e-3, 1e-3, 0.0, 512, 3),
])
def test_the_knee_is_where_power_peaks(d0, d1, d3, context, expected):
    assert knee(decode_model(d0, d1, d3), 64, context) == expected
    assert knee(decode_model(d0, d1, d3), expected - 1, context) == expected - 1   # capped


def test_a_steeper_step_past_8_rows_brings_the_knee_down():
    assert knee(decode_model(6e-3, 5e-4, d2=2.5e-3), 64, 512) < 12


def test_the_serving_overhead_moves_the_knee():
    """A served step of 6 ms + 2 ms (per step) + 0.5 ms a row: the fixed part is 8 ms, the
    knee 16; with 0.5 ms more a streamed token, 6 / (0.5 + 0.5) = 6."""
    model = decode_model(6e-3, 5e-4)
    assert knee(model, 64, 512, ServingOverhead(2e-3, 0.0, measured=True)) == 16
    assert knee(model, 64, 512, ServingOverhead(0.0, 5e-4, measured=True)) == 6


@pytest.fixture()
def knee_profile(tmp_path, smollm_path, smollm_tokenizer):
    """A profile whose decode step costs 6 ms + 0.5 ms a row + 1 us a key read: its knee at
    the default context of 512 tokens is 6 / (0.5 + 0.512) = 5.9, and B / s(B)^2 is higher at
    6 than at 5."""
    path = tmp_path / "profile.json"
    make_profile(smollm_path, smollm_tokenizer, decode_model(6e-3, 5e-4, 1e-6)).save(path)
    return path


def test_route_takes_its_target_from_the_plan_and_an_explicit_one_wins(knee_profile):
    parser = build_parser()
    args = parser.parse_args(["route", "--plan", str(knee_profile), "--max-replicas", "4"])
    assert target_ongoing(args) == (6.0, f"the knee of {knee_profile}")
    assert router_config(args, ServerConfig()).autoscale.target_ongoing == 6.0
    args = parser.parse_args(["route", "--plan", str(knee_profile), "--target-ongoing", "2.5",
                              "--max-replicas", "4"])
    assert router_config(args, ServerConfig()).autoscale.target_ongoing == 2.5
    args = parser.parse_args(["route", "--max-replicas", "4"])
    assert router_config(args, ServerConfig()).autoscale.target_ongoing == 4.0


def test_the_knee_fits_the_kv_cache(smollm_path, smollm_tokenizer):
    """A cache of 3 requests of 512 tokens caps the knee at 3."""
    profile = make_profile(smollm_path, smollm_tokenizer, decode_model(6e-3, 5e-4, 1e-6))
    small = replace(profile, kv_cache_gib=3 * 512 * profile.kv_bytes_per_token / (1 << 30))
    assert profile_knee(small) == 3 and profile_knee(profile) == 6
