"""ember: an LLM inference engine and serving stack in readable PyTorch."""
from ember.config import CacheConfig, EngineConfig, SchedulerConfig
from ember.engine.llm import LLM
from ember.errors import (BadSamplingParams, ConfigError, ContextTooLong, EmberError, EngineDead,
                          InvalidRequest, ModelLoadError, Overloaded, RequestFailed,
                          UnsupportedModel)
from ember.request import CompletionOutput, FinishReason, RequestOutput, SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason",
    "EngineConfig", "CacheConfig", "SchedulerConfig",
    "EmberError", "ConfigError", "ModelLoadError", "UnsupportedModel", "InvalidRequest",
    "BadSamplingParams", "ContextTooLong", "Overloaded", "RequestFailed", "EngineDead",
]
__version__ = "0.1.0"
