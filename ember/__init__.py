"""ember: an LLM inference engine and serving stack in readable PyTorch."""
from typing import TYPE_CHECKING, Any

from ember.config import CacheConfig, EngineConfig, SchedulerConfig
from ember.errors import (BadSamplingParams, ConfigError, ContextTooLong, EmberError, EngineDead,
                          EngineLoading, InvalidRequest, ModelLoadError, Overloaded, RequestFailed,
                          UnsupportedModel)
from ember.request import CompletionOutput, FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from ember.engine.llm import LLM

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason",
    "EngineConfig", "CacheConfig", "SchedulerConfig",
    "EmberError", "ConfigError", "ModelLoadError", "UnsupportedModel", "InvalidRequest",
    "BadSamplingParams", "ContextTooLong", "Overloaded", "RequestFailed", "EngineDead",
    "EngineLoading",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; load it on first use so that `ember.bench` and the tokenizer stay light
    if name == "LLM":
        from ember.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
