"""What every handler reads: the engine, the config, the metrics. Held on `app.state`."""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from ember.config import ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.server.errors import NotFound, PayloadTooLarge, Unauthorized, Unavailable
from ember.server.metrics import ServerMetrics
from ember.server.protocol import parse_body
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

    def check_model(self, model: str | None) -> None:
        """`model` is a served name, never a path; None means the one model served."""
        if model is not None and model != self.model_name:
            raise NotFound(f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r} (see /v1/models)", param="model")

    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            tok = self.engine.tokenizer
            self._chat_template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
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


async def guard(request: Request) -> None:
    """Bearer auth (constant-time compare) and the drain: run before every model endpoint."""
    state = server_state(request)
    key = state.config.api_key
    if key is not None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise Unauthorized("missing or wrong API key; send 'Authorization: Bearer <key>'")
    if state.draining:
        raise Unavailable("the server is shutting down; send the request to another replica")


async def read_json_body(request: Request, model: type[M]) -> M:
    """The body, at most max_body_bytes, parsed and validated into `model`."""
    limit = server_state(request).config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    config = server_state(request).config
    return parse_body(b"".join(chunks), model, config.max_json_depth, config.max_n)
