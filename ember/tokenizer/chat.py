"""Chat templates from the model files, rendered in jinja2's immutable sandbox.

Templates come only from the model's own files, never from a request. The sandbox keeps a
template from reaching Python internals; rendering matches transformers' apply_chat_template.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import InvalidRequest, UnsupportedModel

if TYPE_CHECKING:
    from ember.tokenizer.tokenizer import Tokenizer

Message = dict[str, Any]


def _raise_exception(message: str) -> None:
    raise InvalidRequest(f"the model's chat template refused these messages: {message}",
                         param="messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str | None, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        if not source:
            raise UnsupportedModel("this model's files have no chat template, so it cannot "
                                   "chat; send plain prompts (completions) instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise UnsupportedModel(f"the model's chat template does not compile ({e})") from e
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.knows_tools = "tools" in source  # the template renders tool definitions itself

    @classmethod
    def of(cls, tokenizer: "Tokenizer") -> "ChatTemplate":
        """The chat template a model's tokenizer files carry, with their special tokens."""
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(self, messages: list[Message], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener if asked."""
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except InvalidRequest:
            raise
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template could not render these messages ({e}); "
                                 "check each message's role and content", param="messages") from e


def _check_messages(messages: list[Message]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects",
                             param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'",
                                 param="messages")
