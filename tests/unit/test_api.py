"""The public API is small and pinned, and configs check themselves when built."""
from __future__ import annotations

import pytest

import ember
from ember.config import CacheConfig, EngineConfig, SchedulerConfig
from ember.errors import ConfigError, ContextTooLong, EmberError, InvalidRequest


def test_exported_names_are_pinned():
    assert sorted(ember.__all__) == sorted([
        "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason",
        "EngineConfig", "CacheConfig", "SchedulerConfig",
        "EmberError", "ConfigError", "ModelLoadError", "UnsupportedModel", "InvalidRequest",
        "BadSamplingParams", "ContextTooLong", "Overloaded", "RequestFailed", "EngineDead",
        "EngineLoading"])
    for name in ember.__all__:
        assert getattr(ember, name) is not None


def test_errors_carry_http_status_and_openai_type():
    assert issubclass(ContextTooLong, InvalidRequest) and issubclass(InvalidRequest, EmberError)
    e = ContextTooLong(100, 20, 110)
    assert (e.http_status, e.error_type) == (400, "invalid_request_error")
    assert "100 tokens" in e.message and "max_tokens=20" in e.message and "110" in e.message
    assert ember.Overloaded("busy").http_status == 429
    assert ember.EngineDead("dead").http_status == 503
    assert (ember.EngineLoading("loading").http_status, ember.EngineLoading.error_type) == \
        (503, "engine_loading_error")


@pytest.mark.parametrize("build,match", [
    (lambda: CacheConfig(block_size=0), "power of two"),
    (lambda: CacheConfig(kv_cache_gib=0), "must be positive"),
    (lambda: CacheConfig(num_blocks=-1), "num_blocks"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: EngineConfig(dtype="float8"), "float32, bfloat16"),
    (lambda: EngineConfig(kernels="triton"), "kernels='triton' .*auto, torch"),
    (lambda: CacheConfig(eviction_policy="fifo"), "lru, lfu, cost"),
    (lambda: EngineConfig(max_model_len=0), "max_model_len"),
    (lambda: EngineConfig.from_options(kv_cache_gb=1), "did you mean kv_cache_gib"),
    (lambda: EngineConfig.from_options(zzz=1), "known options"),
])
def test_configs_reject_bad_values_with_the_fix(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_from_options_routes_each_option_to_its_config():
    cfg = EngineConfig.from_options(model="m.gguf", block_size=32, max_num_seqs=4, seed=3)
    assert cfg.model == "m.gguf" and cfg.seed == 3
    assert cfg.cache.block_size == 32 and cfg.scheduler.max_num_seqs == 4
