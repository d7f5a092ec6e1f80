"""`ember plan` and `ember plan profile` from the command line (ember.cli.main)."""
from __future__ import annotations

import json

import pytest

from ember.bench import report
from ember.cli import main
from ember.plan.profile import load_profile
from ember.plan.stepmodel import StepShape

WORKLOAD = ["--num-requests", "150", "--input-len", "fixed:200", "--output-len", "fixed:24",
            "--seed", "3"]
SLO = ["--slo", "ttft_p99=300ms,itl_p99=60ms"]


@pytest.fixture()
def profile_file(tmp_path, profile):
    path = tmp_path / "profile.json"
    profile.save(path)
    return path


def test_the_replicas_a_rate_needs(tmp_path, profile_file, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile_file), "--rate", "40", *WORKLOAD, *SLO,
                 "--cost-per-hour", "2.5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    n = data["answer"]["replicas"]
    assert n >= 2 and f"replicas needed: {n}" in text
    assert "per million output tokens" in text
    points = {(p["replicas"], p["rate"]): p for p in data["points"]}
    assert points[(n, 40.0)]["meets_slo"] and not points[(n - 1, 40.0)]["meets_slo"]
    assert data["curve"]["chosen"] == {"rate": 40.0, "replicas": n}
    assert len(data["curve"]["points"]) >= 5 and (tmp_path / "plan.png").stat().st_size > 0


def test_one_fleet_is_reported_as_a_bench_run(tmp_path, profile_file, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile_file), "--replicas", "2", "--rate", "20",
                 *WORKLOAD, "--out", str(out)]) == 0
    assert "TTFT" in capsys.readouterr().out
    run = json.loads((tmp_path / "plan-run.json").read_text())
    assert run["completed"] == 150 and run["config"]["simulated"]
    assert report.compare([("sim", run), ("again", run)]).count("(1.00x)") >= 3


def test_the_rate_a_fleet_holds_grows_with_the_fleet(tmp_path, profile_file):
    rates = []
    for n in (1, 3):
        out = tmp_path / f"at{n}.json"
        assert main(["plan", "--profile", str(profile_file), "--at-replicas", str(n),
                     *WORKLOAD, *SLO, "--out", str(out)]) == 0
        rates.append(json.loads(out.read_text())["answer"]["rate"])
    assert 0 < rates[0] < rates[1]


def test_the_capacity_curve_needs_more_replicas_for_more_load(tmp_path, profile_file, capsys):
    out = tmp_path / "curve.json"
    assert main(["plan", "--profile", str(profile_file), "--rates", "10,40,80", *WORKLOAD,
                 *SLO, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["answer"]["curve"]
    needed = [r["replicas"] for r in rows]
    assert [r["rate"] for r in rows] == [10.0, 40.0, 80.0]
    assert needed == sorted(needed) and needed[0] < needed[-1]
    assert "80 req/s: " in capsys.readouterr().out


def test_mistakes_say_what_to_do(tmp_path, profile_file, capsys):
    assert main(["plan", "--profile", str(profile_file), "--rate", "5"]) == 2
    assert "--slo is needed" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--rate", "5", *SLO]) == 2
    assert "ember plan profile" in capsys.readouterr().err
    assert main(["plan", "--profile", str(profile_file), "--rates", "1,2",
                 "--at-replicas", "2", *SLO]) == 2
    assert "ask one question" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.heavy   # a minute of CPU
def test_profile_measures_the_default_model(tmp_path, smollm_path, smollm_tokenizer, capsys):
    """A short profile of the real engine: steps of every kind were measured, the fitted
    model has no negative term and predicts a longer step for more work, the engine was
    served at every concurrency and its overhead fitted, and the profile carries the model's
    own tokenizer."""
    out = tmp_path / "profile.json"
    assert main(["plan", "profile", "--max-seconds", "1", "--kv-cache-gib", "0.25",
                 "--out", str(out), "-q"]) == 0
    assert "steps measured" in capsys.readouterr().out
    profile = load_profile(out)
    kinds = {("prompt" if s["prompt_rows"] else "") + ("decode" if s["decode_rows"] else "")
             for s in profile.steps}
    assert {"prompt", "decode"} <= kinds
    model = profile.step_model
    assert all(c >= 0 for c in model.coefficients)
    assert model.predict(StepShape(512, 512 * 513 // 2)) > model.predict(StepShape(16, 136))
    text = "Capacity planning, measured."
    assert profile.load_tokenizer().encode(text) == smollm_tokenizer.encode(text)
    assert profile.model_name == smollm_path.stem and profile.kv_bytes_per_token > 0
    serving = profile.serving
    assert serving.measured and serving.per_step_s >= 0 and serving.per_token_s >= 0
    assert [r["concurrency"] for r in serving.runs] == [1, 2, 4, 8, 16]
    assert all(r["steps"] > 0 for r in serving.runs)
