"""What `ember route` hands its local replicas, and what it says when they cannot start. The
reference for the options is `ember serve` parsing the same tokens itself."""
from __future__ import annotations

import sys
import time

import httpx
import pytest

from ember.cli import build_parser
from ember.router.cli import serve_argv
from ember.router.replicas import LocalLauncher
from tests.router.conftest import LiveGateway

GATEWAY_STATE = {"command", "func", "route_only", "host", "port"}


def route_and_serve(tokens: list[str]) -> tuple[list[str], dict, dict]:
    """The tokens a replica gets, and what `ember route` and `ember serve` parsed of the
    options they share."""
    parser = build_parser()
    route = parser.parse_args(["route", *tokens])
    argv = serve_argv(tokens, route.route_only)
    serve = vars(parser.parse_args(["serve", *argv]))
    shared = {k: v for k, v in vars(route).items() if k in serve and k not in GATEWAY_STATE}
    return argv, shared, {k: serve[k] for k in shared}


@pytest.mark.parametrize("tokens, forwarded", [
    # a repeatable option, given twice, and a flag
    (["--lora", "a1=/adapters/one", "--replicas", "2", "--lora", "b2=/adapters/two",
      "--no-prefix-caching"],
     ["--lora", "a1=/adapters/one", "--lora", "b2=/adapters/two", "--no-prefix-caching"]),
    # a value with spaces, a short flag, --opt=value forms, the gateway's own host and port
    (["--served-model-name", "my model v2", "-q", "--port=9000", "--host", "0.0.0.0",
      "--max-waiting=7", "--policy", "least-load"],
     ["--served-model-name", "my model v2", "-q", "--max-waiting=7"]),
    # route-only repeatable and optional-value options are stripped with their values
    (["--replica-url", "http://a:1", "--replica-url", "http://b:2", "--ray", "--model",
      "m.gguf", "--canary", "new.gguf:10", "--ttft-slo", "2"],
     ["--model", "m.gguf"]),
    (["--ray", "10.0.0.1:6379", "--kv-cache-gib", "0.5"], ["--kv-cache-gib", "0.5"]),
    # a disaggregated fleet's sizes stay with the gateway; the transfer options go on
    (["--prefill-replicas", "1", "--decode-replicas", "2", "--disagg-min-tokens", "256",
      "--kv-transport", "http", "--max-decode-replicas", "3", "--kv-pin-seconds=5"],
     ["--kv-transport", "http", "--kv-pin-seconds=5"]),
])
def test_replicas_get_the_users_serve_tokens_verbatim(tokens, forwarded):
    argv, routed, served = route_and_serve(tokens)
    assert argv == forwarded
    assert served == routed     # a replica parses what the gateway parsed, lists included


def test_a_replica_that_dies_before_ready_says_why_and_is_not_restarted_forever(tmp_path):
    launcher = LocalLauncher([], log_dir=str(tmp_path))
    launcher.command = lambda port: [sys.executable, "-c", (
        "import sys; print('loading adapter a1'); "
        "print('error: no LoRA adapter at /nowhere; check --lora', file=sys.stderr); "
        "sys.exit(2)")]
    gw = LiveGateway({}, launchers={"primary": launcher}, restart_backoff_s=0.01,
                     max_early_deaths=3)
    try:
        gw.fleet.start_replica("primary")
        deadline = time.monotonic() + 30
        while not gw.fleet.failures:
            assert time.monotonic() < deadline, httpx.get(gw.url + "/fleet").json()
            time.sleep(0.05)
        fleet = httpx.get(gw.url + "/fleet").json()
        (replica,) = fleet["replicas"]
        assert replica["state"] == "failed" and replica["restarts"] == 2   # 3 starts in all
        assert replica["last_exit"]["code"] == 2
        assert replica["last_exit"]["log_tail"][-1] == \
            "error: no LoRA adapter at /nowhere; check --lora"
        assert "no LoRA adapter" in fleet["failures"]["primary"]
        ready = httpx.get(gw.url + "/health/ready")
        assert ready.status_code == 503 and "no LoRA adapter" in ready.json()["reason"]
        answer = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 503 and "no LoRA adapter" in answer.text
        time.sleep(0.3)                                 # many restart periods: none comes
        assert httpx.get(gw.url + "/fleet").json()["replicas"][0]["restarts"] == 2
    finally:
        gw.close()


@pytest.mark.parametrize("options", [
    ["--replicas", "2"], ["--ray"], ["--max-replicas", "3"], ["--scale-to-zero-after=60"],
    ["--min-replicas", "0", "--ttft-slo", "1"],
])
def test_replica_urls_refuse_the_options_of_a_local_fleet(options, monkeypatch, capsys):
    from ember.cli import main
    from ember.router import main as route_main

    def never(*args, **kwargs):
        raise AssertionError("the gateway started, ignoring " + " ".join(options))
    monkeypatch.setattr(route_main.GracefulServer, "run", never)
    assert main(["route", "--replica-url", "http://127.0.0.1:9", *options]) == 2
    error = capsys.readouterr().err
    assert "--replica-url" in error and options[0].partition("=")[0] in error


def test_a_replica_whose_port_was_taken_starts_again_on_another(tmp_path):
    """The port is picked free, then bound by the replica later: another process may take
    it in between. That exit is not the replica's fault: restarted at once, never given up."""
    launcher = LocalLauncher([], log_dir=str(tmp_path))
    ports: list[int] = []

    def taken(port: int) -> list[str]:
        ports.append(port)
        return [sys.executable, "-c", (
            f"print(\"ERROR: [Errno 98] error while attempting to bind on address "
            f"('127.0.0.1', {port}): address already in use\"); raise SystemExit(1)")]
    launcher.command = taken
    gw = LiveGateway({}, launchers={"primary": launcher}, restart_backoff_s=5,
                     max_early_deaths=1)
    try:
        gw.fleet.start_replica("primary")
        deadline = time.monotonic() + 30
        while len(ports) < 3:                      # no 5 s backoff, no giving up
            assert time.monotonic() < deadline, httpx.get(gw.url + "/fleet").json()
            time.sleep(0.05)
        assert not gw.fleet.failures
        assert gw.fleet.replicas["p1"].early_deaths == 0
    finally:
        gw.close()


def test_the_dockerfiles_gateway_listens_beyond_the_container():
    from pathlib import Path
    dockerfile = Path(__file__).parents[2] / "Dockerfile"
    examples = [line for line in dockerfile.read_text().splitlines() if "ember route" in line]
    assert examples
    assert all("--host 0.0.0.0" in line for line in examples)
