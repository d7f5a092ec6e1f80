"""The profile file: what `ember plan profile` writes comes back as it was, and a profile
made before the serving overhead was measured loads with none, and says so."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ember.cli import build_parser, main
from ember.errors import ConfigError
from ember.plan.commands import replica_config, serving_text
from ember.plan.profile import load_profile
from ember.plan.stepmodel import ServingOverhead

SERVING = ServingOverhead(
    per_step_s=1.2e-3, per_token_s=0.2e-3, measured=True,
    residuals={"without": {"steps": 40, "median_abs": 0.21, "p90_abs": 0.3, "mean": -0.2},
               "with": {"steps": 40, "median_abs": 0.04, "p90_abs": 0.09, "mean": 0.0,
                          "left_out": 2}},
    runs=[{"concurrency": 4, "client_chunk_gap_p50_s": 9.1e-3, "steps": 90,
           "served_step_p50_s": 9.0e-3, "in_process_p50_s": 7.2e-3,
           "predicted_p50_s": 8.9e-3}])


GATEWAY = ServingOverhead(per_step_s=0.1e-3, per_token_s=0.05e-3, measured=True)


def test_a_profile_with_its_serving_overhead_round_trips(tmp_path, profile):
    path = tmp_path / "profile.json"
    measured = replace(profile, serving=SERVING, gateway=GATEWAY)
    measured.save(path)
    loaded = load_profile(path)
    assert loaded.serving == SERVING and loaded.gateway == GATEWAY
    assert loaded.step_model == measured.step_model
    text = serving_text(loaded)
    assert "1.20 ms a step + 0.200 ms a streamed token" in text
    assert "gateway overhead" in text and "0.10 ms a step + 0.050 ms" in text


def test_the_gateway_overhead_is_added_only_when_asked(tmp_path, profile):
    path = tmp_path / "profile.json"
    replace(profile, serving=SERVING, gateway=GATEWAY).save(path)
    loaded, parser = load_profile(path), build_parser()
    plain = replica_config(loaded, parser.parse_args(["plan", "--profile", str(path)]))
    shared = replica_config(loaded, parser.parse_args(["plan", "--profile", str(path),
                                                       "--gateway-shares-cores"]))
    assert plain.serving == SERVING
    assert shared.serving.seconds(4) == pytest.approx(SERVING.seconds(4) + GATEWAY.seconds(4))
    with pytest.raises(ConfigError, match="--serve-gateway"):
        replica_config(replace(loaded, gateway=ServingOverhead()),
                       parser.parse_args(["plan", "--gateway-shares-cores"]))


def test_a_profile_without_it_loads_with_none_and_says_so(tmp_path, profile, capsys):
    path = tmp_path / "old.json"
    data = replace(profile, serving=SERVING).to_json()
    del data["serving"], data["gateway"]
    path.write_text(json.dumps(data))
    loaded = load_profile(path)
    assert loaded.serving == ServingOverhead() and not loaded.serving.measured
    assert loaded.serving.seconds(8) == 0.0
    assert main(["plan", "--profile", str(path), "--replicas", "1", "--rate", "2",
                 "--num-requests", "5", "--out", str(tmp_path / "plan.json")]) == 0
    assert "served overhead: none in this profile" in capsys.readouterr().out
