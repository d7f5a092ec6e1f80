"""The EmberError tree: every user mistake and every failure a caller can act on.

Each class carries the HTTP status and the OpenAI error type the server will answer with, so the
mapping lives in one place. Messages state the fact *and* the fix.
"""
from __future__ import annotations


class EmberError(Exception):
    """Base of all errors ember raises on purpose."""

    http_status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, as OpenAI reports it


class ConfigError(EmberError):
    """A bad engine option or model file, found at start-up."""


class ModelLoadError(ConfigError):
    """The model files are missing, unreadable or corrupt."""


class UnsupportedModel(ModelLoadError):
    """The model files are valid but describe something ember cannot run."""


class InvalidRequest(EmberError):
    """The request itself is wrong; the caller must change it."""

    http_status = 400
    error_type = "invalid_request_error"


class BadSamplingParams(InvalidRequest):
    """A sampling parameter is out of range or of the wrong kind."""


class ContextTooLong(InvalidRequest):
    """The prompt plus the tokens asked for do not fit in the context or the KV cache."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, limit: int,
                 what: str = "the context") -> None:
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens and max_tokens={max_tokens}, but {what} "
            f"holds {limit} tokens; shorten the prompt or lower max_tokens")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


class AdapterNotFound(EmberError):
    """A request names a model that is neither the served one nor a loaded LoRA adapter."""

    http_status = 404
    error_type = "not_found_error"


class Overloaded(EmberError):
    """Too much work is queued; retry later (the server adds Retry-After)."""

    http_status = 429
    error_type = "rate_limit_error"


class TooManySequences(Overloaded):
    """One request of more sequences than the queue ever takes: every server with these
    options refuses it alike, and none of them is the worse for it (a router in front must
    not take them for full)."""


class RequestFailed(EmberError):
    """This one request failed inside the engine; the others keep running."""


class EngineDead(EmberError):
    """The engine loop has stopped; no request can be served until a restart."""

    http_status = 503
    error_type = "engine_dead_error"


class EngineLoading(EmberError):
    """The model is still loading; retry in a few seconds (the server adds Retry-After).
    Not EngineDead: a client that gives up on a dead server should wait for this one."""

    http_status = 503
    error_type = "engine_loading_error"
