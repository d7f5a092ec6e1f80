"""max_model_len never exceeds what the KV cache holds (reference: num_blocks x block_size of
a tiny cache, smaller than the tiny model's 512-token context)."""
from __future__ import annotations

import logging
import time

import httpx
import pytest

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from tests.server.conftest import LiveServer

BLOCK_SIZE = 16
NUM_BLOCKS = 8
CAPACITY = BLOCK_SIZE * NUM_BLOCKS  # 128 tokens, the model's context is 512


@pytest.fixture(scope="module")
def small_cache_server(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"num_blocks": NUM_BLOCKS,
                                              "block_size": BLOCK_SIZE})
    yield live
    live.close()


def test_max_model_len_is_clipped_to_the_kv_cache_and_the_log_says_so(tiny_llama_dir, caplog):
    folder, _ = tiny_llama_dir
    with caplog.at_level(logging.WARNING, logger="ember.engine.core"):
        core = EngineCore(EngineConfig.from_options(model=str(folder), dtype="float32",
                                                    num_blocks=NUM_BLOCKS,
                                                    block_size=BLOCK_SIZE))
    assert core.model_config.context_limit() == 512
    assert core.max_model_len == CAPACITY == core.scheduler.kv.capacity_tokens
    [warning] = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert "512" in warning and str(CAPACITY) in warning and "--kv-cache-gib" in warning


def test_a_max_model_len_the_cache_holds_is_kept(tiny_llama_dir, caplog):
    folder, _ = tiny_llama_dir
    with caplog.at_level(logging.WARNING, logger="ember.engine.core"):
        core = EngineCore(EngineConfig.from_options(model=str(folder), dtype="float32",
                                                    max_model_len=100, num_blocks=NUM_BLOCKS,
                                                    block_size=BLOCK_SIZE))
    assert core.max_model_len == 100
    assert not [r for r in caplog.records if "max_model_len" in r.getMessage()]


def test_the_api_reports_the_clipped_length_and_refuses_longer_requests(small_cache_server):
    models = httpx.get(small_cache_server.url + "/v1/models", timeout=30).json()
    assert [m["max_model_len"] for m in models["data"]] == [CAPACITY]
    r = httpx.post(small_cache_server.url + "/v1/completions", timeout=60,
                   json={"prompt": [5] * CAPACITY, "max_tokens": 8})
    assert r.status_code == 400, r.text
    assert str(CAPACITY) in r.json()["error"]["message"]
    cut = httpx.post(small_cache_server.url + "/v1/completions", timeout=60,
                     json={"prompt": [5] * (CAPACITY - 4), "max_tokens": 8, "ignore_eos": True})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["completion_tokens"] == 4  # max_tokens cut to the room left
    ok = httpx.post(small_cache_server.url + "/v1/completions", timeout=60,
                    json={"prompt": [5] * (CAPACITY - 8), "max_tokens": 8})
    assert ok.status_code == 200, ok.text


def test_an_idle_server_faults_its_kv_cache_in_and_what_it_cached_survives(tiny_llama_dir):
    """Idle, the engine maps its lazily allocated KV cache in, a huge page at a time, so that
    serving does not fault it in; blocks a request wrote before are kept: the same greedy
    request after it, served from the prefix cache, gets the same tokens."""
    from tests.unit.test_kv import _resident_fraction
    folder, _ = tiny_llama_dir
    live = LiveServer(folder)
    try:
        body = {"prompt": " ".join(f"item {i}" for i in range(40)), "max_tokens": 8,
                "temperature": 0}
        first = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        caches = live.engine.core.runner.kv_caches
        deadline = time.monotonic() + 120   # a bound for slow machines, not a speed
        while any(_resident_fraction(kv.data) < 1 for kv in caches):
            assert time.monotonic() < deadline, "the idle engine never faulted its cache in"
            time.sleep(0.1)
        again = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        assert again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        live.close()
