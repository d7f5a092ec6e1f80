"""LoRA adapters through the HTTP API: /v1/models, a request's `model`, run-time load/unload.

Reference: the offline engine with the same adapters (itself checked against peft in
tests/reference/test_lora.py).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ember import LLM, SamplingParams
from ember.request import RequestOptions
from tests.reference.test_lora import make_adapter
from tests.server.conftest import LiveServer

pytest.importorskip("peft")
PROMPT = [1, 500, 77, 9000, 31, 2024, 17]
KEY = "sk-admin"


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    _, base = tiny_llama_dir
    paths = {}
    for seed, name in enumerate(["alpha", "beta", "gamma"]):
        paths[name] = tmp_path_factory.mktemp(f"adapter_{name}")
        make_adapter(base, paths[name], 8, 16, seed == 1, ["q_proj", "v_proj", "down_proj"],
                     seed)
    return paths


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir, adapters):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_model_len": 512, "loras": (
        ("alpha", str(adapters["alpha"])), ("beta", str(adapters["beta"])))}, api_key=KEY)
    yield live
    live.close()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, adapters) -> LLM:
    folder, _ = tiny_llama_dir
    return LLM(str(folder), dtype="float32",
               loras=tuple((n, str(p)) for n, p in adapters.items()))


def complete(server: LiveServer, model: str, max_tokens: int = 8, key: str = KEY
             ) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True}, timeout=60)


def offline_text(offline: LLM, lora: str | None, max_tokens: int = 8) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([PROMPT], params, RequestOptions(lora=lora))[0].outputs[0].text


def test_models_lists_adapters_with_their_parent(lora_server) -> None:
    cards = httpx.get(lora_server.url + "/v1/models",
                      headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    base = cards[0]["id"]
    assert [(c["id"], c["parent"]) for c in cards] == [(base, None), ("alpha", base),
                                                       ("beta", base)]


def test_model_names_the_adapter(lora_server, offline) -> None:
    base = lora_server.state.model_name
    texts = {}
    for model in (base, "alpha", "beta"):
        r = complete(lora_server, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
    assert texts[base] == offline_text(offline, None)
    assert texts["alpha"] == offline_text(offline, "alpha")
    assert texts["beta"] == offline_text(offline, "beta")
    assert len(set(texts.values())) == 3


def test_concurrent_mixed_adapters_match_each_alone(lora_server, offline) -> None:
    base = lora_server.state.model_name
    models = [base, "alpha", "beta", "alpha", base, "beta"] * 2
    with ThreadPoolExecutor(len(models)) as pool:
        responses = list(pool.map(lambda m: complete(lora_server, m, 12), models))
    for model, r in zip(models, responses):
        assert r.status_code == 200, r.text
        want = offline_text(offline, None if model == base else model, 12)
        assert r.json()["choices"][0]["text"] == want, model
    lora_server.wait_idle()


def test_unknown_model_is_a_404_naming_the_choices(lora_server) -> None:
    r = complete(lora_server, "nope")
    assert r.status_code == 404
    assert "'alpha'" in r.json()["error"]["message"]


def test_load_and_unload_at_run_time(lora_server, offline, adapters) -> None:
    url, auth = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(lora_server, "gamma").json()["choices"][0]["text"] == \
        offline_text(offline, "gamma")
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and "taken" in again.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers=auth)
    assert r.status_code == 200
    assert complete(lora_server, "gamma").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers=auth)
    assert r.status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, "lora_path"),
    ({"lora_name": "", "lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "x" * 129, "lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "x"}, "lora_path"),
])
def test_bad_load_requests_are_400s(lora_server, body, param) -> None:
    r = httpx.post(lora_server.url + "/v1/load_lora_adapter", json=body,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert param in r.text


def test_a_folder_that_is_not_an_adapter_is_a_400(lora_server, tmp_path: Path) -> None:
    r = httpx.post(lora_server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "x", "lora_path": str(tmp_path)},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]


def test_metrics_per_adapter(lora_server) -> None:
    before = lora_server.metric('ember_lora_requests_total{adapter="beta"}')
    assert complete(lora_server, "beta", 5).status_code == 200
    lora_server.wait_idle()
    assert lora_server.metric('ember_lora_requests_total{adapter="beta"}') == before + 1
    assert lora_server.metric('ember_lora_generation_tokens_total{adapter="beta"}') >= 5


def test_the_same_files_under_another_name_find_its_cached_prefix(lora_server, adapters
                                                                 ) -> None:
    """An adapter's KV blocks are salted by the digest of its files, not by the order it was
    loaded in: the same files loaded later under another name (as on another replica, where
    the order differs) find the prompt the first name cached; other weights find nothing."""
    url, auth = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "alpha_again", "lora_path": str(adapters["alpha"])}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body, headers=auth,
                      timeout=60).status_code == 200
    try:
        cards = {c["id"]: c for c in httpx.get(url + "/v1/models", headers=auth).json()["data"]}
        assert cards["alpha_again"]["digest"] == cards["alpha"]["digest"]
        assert cards["alpha"]["digest"] != cards["beta"]["digest"]
        assert cards["alpha"]["digest"].startswith("sha256:")
        prompt = [7 + (i * 37) % 5000 for i in range(80)]   # 5 blocks, in no other test

        def cached(model: str) -> int:
            r = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached("alpha") == 0
        assert cached("alpha_again") >= 64
        assert cached("beta") == 0
    finally:
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "alpha_again"},
                   headers=auth)


def test_a_split_model_serves_adapters_from_start_and_run_time(tiny_llama_dir, adapters,
                                                               offline) -> None:
    """tensor_parallel_size=2: an adapter given at start and one loaded through the API
    reach both ranks, in a batch beside the base model (the one-process engine's text)."""
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_model_len": 512, "tensor_parallel_size": 2,
                                              "loras": (("alpha", str(adapters["alpha"])),)},
                      api_key=KEY)
    try:
        r = httpx.post(live.url + "/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        base = live.state.model_name
        models = [base, "alpha", "gamma", "alpha", base, "gamma"]
        with ThreadPoolExecutor(len(models)) as pool:
            responses = list(pool.map(lambda m: complete(live, m, 12), models))
        for model, r in zip(models, responses):
            assert r.status_code == 200, r.text
            want = offline_text(offline, None if model == base else model, 12)
            assert r.json()["choices"][0]["text"] == want, model
    finally:
        live.close()
