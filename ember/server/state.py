"""What every handler reads: the engine, the config, the metrics, and who sent the request
(its key's tenant) and when it arrived. Held on `app.state`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from ember.config import ApiKey, ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.server.errors import NotFound, Unavailable, read_body
from ember.server.metrics import ServerMetrics
from ember.server.protocol import parse_body
from ember.server.tenants import match_key, tenant_salts
from ember.tokenizer.answers import AnswerTokens
from ember.tokenizer.chat import ChatTemplate

M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    _chat_template: ChatTemplate | None = None
    _answers: AnswerTokens | None = None
    keys: tuple[ApiKey, ...] = field(init=False)  # with tenants: every accepted key
    tenant_salts: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = self.config.tenant_keys()
        self.tenant_salts = tenant_salts(self.keys)

    def check_model(self, model: str | None) -> str | None:
        """`model` is a served name, never a path; None means the one model served. Returns
        the LoRA adapter it names, or None for the base model."""
        if model is None or model == self.model_name:
            return None
        adapters = self.engine.lora_names()
        if model in adapters:
            return model
        served = ", ".join(repr(n) for n in [self.model_name, *adapters])
        raise NotFound(f"model {model!r} does not exist; this server serves {served} (see "
                       "/v1/models)", param="model")

    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate.of(self.engine.tokenizer)
        return self._chat_template

    def answers(self) -> AnswerTokens:
        """Earlier chat answers' generated token ids (tokenizer/answers.py)."""
        if self._answers is None:
            self._answers = AnswerTokens(self.engine.tokenizer)
        return self._answers

    def max_model_len(self) -> int | None:
        core = self.engine.core
        return core.max_model_len if core is not None else None


def server_state(request: Request) -> ServerState:
    return request.app.state.ember


async def authenticate(request: Request) -> None:
    """Bearer auth (constant-time compare). With tenants, the key's tenant is kept on the
    request (see `request_tenant`)."""
    state = server_state(request)
    if state.keys:
        request.state.tenant = match_key(request.headers.get("authorization", ""),
                                         state.keys)
    elif state.config.api_key is not None:
        match_key(request.headers.get("authorization", ""),
                  (ApiKey(state.config.api_key, "default"),))


async def guard(request: Request) -> None:
    """Auth and the drain: run before every model endpoint."""
    await authenticate(request)
    state = server_state(request)
    if state.draining:
        raise Unavailable("the server is shutting down; send the request to another replica")


def request_tenant(request: Request) -> ApiKey | None:
    """The tenant `guard` found for this request; None on a server without tenants."""
    return getattr(request.state, "tenant", None)


ARRIVAL = "ember_arrival"


class ArrivalTime:
    """ASGI middleware: stamps each request's arrival (time.monotonic) before anything reads
    its body, so latencies include parsing, templating and tokenizing, as the client sees."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL] = time.monotonic()
        await self.app(scope, receive, send)


def arrival_time(request: Request) -> float:
    return getattr(request.state, ARRIVAL, None) or time.monotonic()


async def read_json_body(request: Request, model: type[M]) -> M:
    """The body, at most max_body_bytes, parsed and validated into `model`."""
    config = server_state(request).config
    raw = await read_body(request, config.max_body_bytes)
    return parse_body(raw, model, config.max_json_depth, config.max_n)
