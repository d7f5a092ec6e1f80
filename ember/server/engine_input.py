"""Where a parsed completion or chat request becomes what the engine runs: prompts as token
ids, sampling parameters, request options (with the tenant's salt and priority) and grammar.

Tokenizing and chat templating run in a worker thread: a prompt of megabytes takes a second
or more to encode, and meanwhile the event loop keeps every other stream moving.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import anyio

from ember.config import ApiKey
from ember.constraint import Constraint
from ember.errors import InvalidRequest
from ember.kv_transfer.params import RemotePrefill, remote_prefill
from ember.request import RequestOptions, SamplingParams
from ember.server.errors import Forbidden
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from ember.server.state import ServerState
from ember.server.tenants import tenant_salt
from ember.server.tools import check_tools, render_for_plain_template, tool_constraint
from ember.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInput:
    """One HTTP request's work for the engine: one engine request per prompt."""

    prompts: list[list[int]]
    params: SamplingParams
    options: RequestOptions
    grammar: object | None = None
    texts: tuple[str, ...] = ()                  # completions: each prompt's text, if echoed
    functions: list[dict[str, Any]] | None = None  # chat: the tools the model may call
    export_kv: bool = False                      # a prefill replica's part (kv_transfer/)
    remote: RemotePrefill | None = None          # a decode replica's part


def with_transfer(work: EngineInput, body: SamplingFields, authorization: str | None,
                  peers: tuple[str, ...] = ()) -> EngineInput:
    """The request's part in disaggregated serving, from its kv_transfer_params: the decode
    replica shows the prefill replica (a host among `peers`, or loopback where there are
    none) the credentials this request came with."""
    params = body.kv_transfer_params
    if params is None:
        return work
    body.check_transfer(work.grammar is not None)
    if len(work.prompts) != 1 or work.texts:
        raise InvalidRequest("kv_transfer_params takes one prompt, without echo",
                             param="kv_transfer_params")
    if params.do_remote_decode:
        return replace(work, export_kv=True)
    check_peer(params.remote_url or "", peers)
    return replace(work, remote=remote_prefill(params.model_dump(), authorization))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_peer(url: str, peers: tuple[str, ...]) -> None:
    """A 400 unless `url`'s host (or host:port) is among `peers` (loopback without any)."""
    parts = urlsplit(url)
    try:
        host_port = f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname
    except ValueError:   # a port out of range
        host_port = None
    allowed = peers or LOOPBACK
    if parts.hostname is None or (parts.hostname not in allowed and host_port not in allowed):
        raise InvalidRequest(f"kv_transfer_params.remote_url {url[:200]!r} is not a prefill "
                             f"replica this decode replica pulls from ({', '.join(allowed)}); "
                             "start it with --kv-peers HOST[:PORT],...",
                             param="kv_transfer_params.remote_url")


async def completion_input(state: ServerState, body: CompletionRequest,
                           tenant: ApiKey | None) -> EngineInput:
    constraint = body.constraint()
    params = body.sampling_params(body.max_tokens, body.logprobs, constraint)
    options = await adapter_options(state, body, tenant_options(body, tenant,
                                                                state.tenant_salts))
    texts, prompts = await anyio.to_thread.run_sync(
        encode_prompts, body.prompt_list(), state.engine.tokenizer, body.echo)
    return EngineInput(prompts, params, options, await compile_grammar(state, constraint),
                       texts=texts)


async def chat_input(state: ServerState, body: ChatCompletionRequest,
                     tenant: ApiKey | None) -> EngineInput:
    functions = check_tools(body.tools) if body.tools and body.tool_choice != "none" else None
    constraint = body.constraint()
    if functions:
        if constraint is not None:
            raise InvalidRequest("tools and response_format cannot be combined in one request",
                                 param="response_format")
        constraint = tool_constraint(functions, body.tool_choice or "auto",
                                     body.parallel_tool_calls)
    params = body.sampling_params(body.max_new_tokens(), body.num_logprobs(), constraint)
    options = await adapter_options(state, body, tenant_options(body, tenant,
                                                                state.tenant_salts))
    prompt = await anyio.to_thread.run_sync(partial(
        chat_prompt, state, body.messages, body.add_generation_prompt,
        body.tools if functions else None, functions))
    return EngineInput([prompt], params, options, await compile_grammar(state, constraint),
                       functions=functions)


async def compile_grammar(state: ServerState, constraint: Constraint | None) -> object | None:
    return await state.engine.compile(constraint) if constraint else None


def encode_prompts(prompts: list[str | list[int]], tokenizer: Tokenizer, echo: bool
                   ) -> tuple[tuple[str, ...], list[list[int]]]:
    """Each prompt's text (only if echoed: a token-id prompt's is decoded) and token ids."""
    ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    if not echo:
        return (), ids
    return tuple(p if isinstance(p, str) else tokenizer.decode(p) for p in prompts), ids


def chat_prompt(state: ServerState, messages: list, add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None,
                functions: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the conversation through the model's template. A template that knows
    tools gets them; for one that does not, tools and calls are written in (tools.py)."""
    template_messages = [m.as_template_message(i) for i, m in enumerate(messages)]
    template = state.chat_template()
    if template.knows_tools:
        text = template.render(template_messages, add_generation_prompt, tools=tools)
    else:
        text = template.render(render_for_plain_template(template_messages, functions),
                               add_generation_prompt)
    answers = [m["content"] for m in template_messages
               if m["role"] == "assistant" and m["content"] and not m.get("tool_calls")]
    try:
        return state.answers().encode(text, answers)
    except KeyError:  # an answer was evicted (on the event loop) between lookup and use
        return state.engine.tokenizer.encode(text, add_special_tokens=False)


def tenant_options(body: SamplingFields, tenant: ApiKey | None, salts: dict[str, str]
                   ) -> RequestOptions:
    """The request's options within its tenant's bounds: cached prefixes salted by tenant, and
    a priority no more important than the key allows (an unset one runs at the allowance)."""
    options = body.request_options()
    if tenant is None:
        return options
    priority, best = options.priority, tenant.best_priority
    if best is not None and priority < best:
        if "priority" in body.model_fields_set:
            raise Forbidden(f"priority={priority} is more important than this API key may ask "
                            f"for; the most important it may use is {best} (lower runs "
                            f"first): send priority >= {best}", param="priority")
        priority = best
    return replace(options, priority=priority,
                   cache_salt=tenant_salt(salts[tenant.tenant], options.cache_salt))


async def adapter_options(state: ServerState, body: SamplingFields,
                          options: RequestOptions) -> RequestOptions:
    """The LoRA adapter that the body's model names, made resident, in the options."""
    lora = state.check_model(body.model)
    if lora is None:
        return options
    await state.engine.prepare_lora(lora)
    return replace(options, lora=lora)

