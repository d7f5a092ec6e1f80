"""Every error is OpenAI's envelope with the right status, and the server stays healthy.

Reference: OpenAI's error shape {"error": {message, type, param, code}}; the statuses the
README's error list promises.
"""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, **kw)


def assert_error(response: httpx.Response, status: int, *words: str, param: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param
    assert "Traceback" not in response.text and "/work/" not in response.text
    return error


@pytest.mark.parametrize("body,words,param", [
    (b"{not json", ["not valid JSON"], None),
    (b"[1, 2]", ["JSON object"], None),
    (b'{"prompt": "x", "frobnicate": 1}', ["unknown parameter 'frobnicate'"], "frobnicate"),
    (b'{"prompt": "x", "temperature": -1}', ["temperature", "[0, 2]"], "temperature"),
    (b'{"prompt": "x", "top_p": 0}', ["top_p"], "top_p"),
    (b'{"prompt": "x", "n": 0}', ["n=0"], "n"),
    (b'{"prompt": "x", "logprobs": 50}', ["logprobs"], "logprobs"),
    (b'{"prompt": "x", "max_tokens": "many"}', ["max_tokens"], "max_tokens"),
    (b'{"prompt": 5}', ["prompt must be"], "prompt"),
    (b'{"prompt": []}', ["prompt must be"], "prompt"),
    (b'{"max_tokens": 3}', ["missing required parameter 'prompt'"], "prompt"),
    (b'{"prompt": "x", "suffix": "y"}', ["suffix", "not supported"], "suffix"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', ["stream=true"], None),
    (b'{"prompt": "x", "logit_bias": {"abc": 1}}', ["logit_bias"], "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"99999999": 1}}', ["vocabulary"], None),
    (b'{"prompt": [[1, 2], [999999999]]}', ["outside the vocabulary"], "prompt"),
    (b'{"prompt": "' + b"hello " * 600 + b'", "max_tokens": 10}', ["tokens and max_tokens=10",
                                                                   "holds 512"], None),
])
def test_bad_completion_requests_get_400(server, body, words, param):
    r = post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, *words, param=param)


@pytest.mark.parametrize("body,words", [
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "wizard", "content": "x"}]}, ["role"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["text-only"]),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     ["tools[0] must be"]),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     ["response_format type 'yaml'"]),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, ["logprobs=true"]),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ evil }}"},
     ["unknown parameter 'chat_template'"]),
])
def test_bad_chat_requests_get_400(server, body, words):
    assert_error(post(server, "/v1/chat/completions", json=body), 400, *words)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="context holds 512"):
        client.completions.create(prompt="hello " * 600, max_tokens=10, model=None)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(prompt="hi", model="gpt-4o")


def test_unknown_model_and_route_get_404(server):
    assert_error(post(server, "/v1/completions", json={"prompt": "x", "model": "/etc/passwd"}),
                 404, "does not exist", param="model")
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, "no route")
    assert_error(httpx.get(server.url + "/v1/models/other"), 404, "does not exist")
    assert_error(httpx.delete(server.url + "/v1/models"), 405)


def test_body_limits_and_nesting(server):
    big = b'{"prompt": "' + b"a" * (server.config.max_body_bytes + 10) + b'"}'
    assert_error(post(server, "/v1/completions", content=big), 413, "limit")
    deep = b'{"prompt": "x", "logit_bias": ' + b'{"a": ' * 40 + b"1" + b"}" * 41
    assert_error(post(server, "/v1/completions", content=deep), 400, "nests deeper")
    deeper = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert_error(post(server, "/v1/completions", content=deeper), 400)


def test_health_and_metrics_names(server):
    assert httpx.get(server.url + "/health/live").json() == {"status": "live"}
    assert httpx.get(server.url + "/health/ready").json() == {"status": "ready"}
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ["ember_time_to_first_token_seconds_bucket", "ember_inter_token_latency_seconds",
                 "ember_time_per_output_token_seconds", "ember_e2e_request_latency_seconds",
                 "ember_request_queue_time_seconds", "ember_request_prompt_tokens",
                 "ember_request_generation_tokens", "ember_num_requests_running",
                 "ember_num_requests_waiting", "ember_kv_cache_usage_perc",
                 "ember_num_preemptions_total", "vllm:num_requests_waiting",
                 "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", 'vllm:cache_config_info{block_size="16"']:
        assert name in text, name


def test_metrics_count_what_happened(server):
    before_tokens = server.metric("ember_generation_tokens_total")
    before_len = server.metric('ember_request_success_total{finish_reason="length"}')
    before_ttft = server.metric("ember_time_to_first_token_seconds_count")
    post(server, "/v1/completions", json={"prompt": "hi", "max_tokens": 7, "ignore_eos": True})
    assert server.metric("ember_generation_tokens_total") == before_tokens + 7
    assert server.metric('ember_request_success_total{finish_reason="length"}') == before_len + 1
    assert server.metric("ember_time_to_first_token_seconds_count") == before_ttft + 1


def test_api_key_is_required_on_v1_only(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, api_key="s3cret")
    try:
        assert_error(httpx.get(live.url + "/v1/models"), 401, "API key")
        bad = httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(bad, 401)
        assert bad.headers["www-authenticate"] == "Bearer"
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0).models.list()
        assert httpx.get(live.url + "/health/ready").status_code == 200
        assert httpx.get(live.url + "/metrics").status_code == 200
        assert_error(post(live, "/tokenize", json={"prompt": "x"}), 401)
    finally:
        live.close()


def test_internal_fault_is_a_plain_500_and_the_server_stays_up(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail at /work/main/ember/x.py")
    monkeypatch.setattr(server.engine, "submit", broken)
    r = post(server, "/v1/completions", json={"prompt": "x"})
    error = assert_error(r, 500, "internal server error")
    assert "secret" not in r.text
    assert error["type"] == "server_error"
    monkeypatch.undo()
    assert post(server, "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_loading_then_ready(tiny_llama_dir, monkeypatch):
    """503 while the model loads; live from the start; ready once loaded and warmed."""
    from ember.engine import async_engine
    gate = threading.Event()
    real = async_engine.EngineCore

    def slow_core(config):
        gate.wait(30)
        return real(config)

    monkeypatch.setattr(async_engine, "EngineCore", slow_core)
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, wait_ready=False)
    try:
        assert httpx.get(live.url + "/health/live").status_code == 200
        ready = httpx.get(live.url + "/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        loading = post(live, "/v1/completions", json={"prompt": "x"})
        assert_error(loading, 503, "loading")
        assert loading.json()["error"]["type"] == "engine_loading_error"
        assert loading.headers["retry-after"]
        gate.set()
        live.wait_ready()
        assert post(live, "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code \
            == 200
    finally:
        gate.set()
        live.close()


def test_dead_engine_fails_streams_with_an_error_event_and_health_turns_503(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder)
    try:
        def crash(only=None):  # not a StepFailed: the engine itself broke
            raise RuntimeError("kernel exploded")
        live.engine.core.step = crash
        r = post(live, "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
        assert r.status_code == 200
        assert '"engine_dead_error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        assert httpx.get(live.url + "/health/ready").json()["status"] == "dead"
        assert httpx.get(live.url + "/health/live").status_code == 503  # no zombie
        assert_error(post(live, "/v1/completions", json={"prompt": "x"}), 503, "restart")
    finally:
        live.close()


def test_stalled_engine_is_not_ready(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, stall_timeout_s=0.3)
    release = threading.Event()
    try:
        live.delay_steps(gate=release)
        thread = threading.Thread(target=post, args=(live, "/v1/completions"),
                                  kwargs={"json": {"prompt": "x", "max_tokens": 2}})
        thread.start()
        deadline = time.monotonic() + 10
        while httpx.get(live.url + "/health/ready").json()["status"] != "stalled":
            assert time.monotonic() < deadline, "the watchdog never saw the stall"
            time.sleep(0.05)
        release.set()
        thread.join(10)
        live.wait_ready(10)
    finally:
        release.set()
        live.close()


def test_request_timeout_ends_the_request_and_frees_it(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, request_timeout_s=0.3)
    try:
        live.delay_steps(0.05)
        r = post(live, "/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                "ignore_eos": True})
        assert_error(r, 504, "limit of 0.3 s")
        streamed = post(live, "/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                       "ignore_eos": True, "stream": True})
        assert '"timeout_error"' in streamed.text
        live.wait_idle()
        assert live.metric('ember_request_aborts_total{reason="timeout"}') == 2
    finally:
        live.close()
