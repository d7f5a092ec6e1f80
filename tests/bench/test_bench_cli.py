"""A tiny `ember bench` run against `ember serve`: valid JSON, JSONL and a PNG, plus sweep,
compare, and where results go without --out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember import cli
from ember.bench.cli import results_dir
from tests.server.conftest import LiveServer


@pytest.fixture(scope="module")
def live(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    server = LiveServer(folder)
    yield server
    server.close()


def test_tiny_run_writes_json_jsonl_and_a_png(live, tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["bench", "serve", "--base-url", live.url + "/v1", "--num-requests", "6",
                     "--concurrency", "3", "--input-len", "uniform:10,40",
                     "--output-len", "fixed:8", "--slo", "ttft=2s,tpot=1s",
                     "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 48 and summary["usage_reported"] is True
    assert summary["goodput"]["fraction"] == 1.0
    assert summary["server_metrics_delta"]['ember_request_success_total{finish_reason='
                                           '"length"}'] == 6
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["output_tokens"] == 8 for r in rows)
    assert all(abs(r["prompt_tokens"] - r["target_prompt_tokens"]) <= 2 for r in rows)
    sweep = tmp_path / "sweep.json"
    assert cli.main(["bench", "sweep", "--base-url", live.url + "/v1", "--num-requests",
                     "4", "--output-len", "fixed:4", "--input-len", "fixed:16",
                     "--concurrencies", "1,4", "--out", str(sweep)]) == 0
    points = json.loads(sweep.read_text())["points"]
    assert [p["config"]["concurrency"] for p in points] == [1, 4]
    png = tmp_path / "plot.png"
    assert cli.main(["bench", "plot", str(sweep), str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    capsys.readouterr()
    assert cli.main(["bench", "compare", str(out), str(sweep)]) == 0
    table = capsys.readouterr().out
    assert "output tok/s" in table and "concurrency=4" in table and "x)" in table


def test_chat_sessions_workload_runs_every_turn(live, tmp_path):
    out = tmp_path / "chat.json"
    assert cli.main(["bench", "serve", "--base-url", live.url + "/v1", "--workload",
                     "chat-sessions", "--sessions", "2", "--turns", "3", "--input-len",
                     "fixed:12", "--output-len", "fixed:6", "--concurrency", "2",
                     "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert sorted((r["session"], r["turn"]) for r in rows) == [(s, t) for s in range(2)
                                                               for t in range(3)]
    by_session = {}
    for r in rows:
        by_session.setdefault(r["session"], []).append(r["prompt_tokens"])
    assert all(a < b < c for a, b, c in (sorted(v) for v in by_session.values()))


def test_mixed_workload_sends_streams_then_long_prompts(live, tmp_path):
    out = tmp_path / "mixed.json"
    assert cli.main(["bench", "serve", "--base-url", live.url + "/v1", "--workload", "mixed",
                     "--streams", "3", "--input-len", "fixed:12", "--stream-output-len", "10",
                     "--long-prompts", "2", "--long-len", "200", "--long-every", "0.2",
                     "--long-output-len", "2", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 5 and summary["output_tokens"] == 3 * 10 + 2 * 2
    assert {k: v["completed"] for k, v in summary["by_kind"].items()} == \
        {"stream": 3, "long": 2}
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    longs = sorted(r["start"] for r in rows if r["kind"] == "long")
    assert longs[0] >= 0.2 - 1e-3 and longs[1] >= 0.4 - 1e-3
    assert all(abs(r["prompt_tokens"] - 200) <= 30 for r in rows if r["kind"] == "long")


def test_offline_bench_writes_its_figures(tiny_llama_dir, tmp_path):
    folder, _ = tiny_llama_dir
    out = tmp_path / "offline.json"
    assert cli.main(["bench", "offline", "--model", str(folder), "--repeats", "1",
                     "--batch-size", "3", "--dtype", "float32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["batch_size"] == 3 and result["prefill_tokens"] == 511
    assert result["decode_tok_per_s"] > 0 and result["prefill_ttft_s"] > 0
    assert result["engine"] == "ember float32" and result["weights"] == "none"


def test_mistakes_get_one_clear_line(tmp_path):
    with pytest.raises(SystemExit, match="could not reach the server"):
        cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9/v1",
                  "--num-requests", "1", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="length distribution 'zipf:2'"):
        cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9/v1", "--workload",
                  "jsonl", "--dataset", str(tmp_path / "none.jsonl"), "--output-len", "zipf:2"])
    with pytest.raises(SystemExit, match="needs --dataset"):
        cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9/v1", "--workload",
                  "jsonl"])


def test_results_go_to_the_user_cache_by_default():
    home = Path("/home/u")
    assert results_dir({}, home) == home / ".cache" / "ember" / "bench"
    assert results_dir({"XDG_CACHE_HOME": "/c"}, home) == Path("/c/ember/bench")
    assert results_dir({"XDG_CACHE_HOME": ""}, home) == home / ".cache" / "ember" / "bench"


def test_a_run_without_out_writes_to_the_cache_not_the_working_directory(live, tmp_path,
                                                                           monkeypatch):
    cwd, cache = tmp_path / "checkout", tmp_path / "cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert cli.main(["bench", "serve", "--base-url", live.url + "/v1", "--num-requests", "2",
                     "--input-len", "fixed:8", "--output-len", "fixed:2"]) == 0
    assert list(cwd.iterdir()) == []
    summary = json.loads((cache / "ember" / "bench" / "bench.json").read_text())
    assert summary["completed"] == 2
    assert (cache / "ember" / "bench" / "bench.jsonl").read_text().count("\n") == 2
