"""Structured output and tool calls over HTTP, through the openai client and raw SSE.

The tiny random model makes a hard test: its logits are noise, so only the grammar keeps the
output valid. References: `jsonschema` for every output, the tool's parameter schema for every
call's arguments, OpenAI's shapes for messages, tool_calls and their streamed deltas.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import jsonschema
import pytest

from ember.constraint import Constraint

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "schemas.json").read_text())
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("case", SCHEMAS, ids=[c["name"] for c in SCHEMAS])
def test_json_schema_outputs_validate_streamed_or_not(client, case):
    fmt = {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"],
                                                  "strict": True}}
    for seed in (1, 2):
        out = client.chat.completions.create(model=None, messages=ASK, response_format=fmt,
                                             max_tokens=400, temperature=1.0, seed=seed)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), case["schema"])
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=None, messages=ASK, response_format=fmt, max_tokens=400, temperature=1.0,
            seed=seed, stream=True) if c.choices)
        assert streamed == out.choices[0].message.content


def test_json_object_regex_choice_grammar_on_both_endpoints(client):
    obj = client.completions.create(model=None, prompt="x", max_tokens=300, temperature=1.0,
                                    seed=3, extra_body={"response_format":
                                                        {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)
    cases = [({"regex": r"[a-c]{2}-\d\d"}, lambda t: len(t) == 5 and t[2] == "-"),
             ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"grammar": 'root ::= "x" | "y" "z"'}, lambda t: t in ("x", "yz"))]
    for spec, check in cases:
        out = client.completions.create(model=None, prompt="x", max_tokens=20, temperature=1.0,
                                        extra_body={"structured_outputs": spec})
        assert check(out.choices[0].text), (spec, out.choices[0].text)
        chat = client.chat.completions.create(model=None, messages=ASK, max_tokens=20,
                                              extra_body={"structured_outputs": spec})
        assert check(chat.choices[0].message.content)


@pytest.mark.parametrize("extreme", [
    {"repetition_penalty": 5e-324}, {"repetition_penalty": 5e-324, "temperature": 1.0},
    {"repetition_penalty": 1e-40, "temperature": 2.0, "top_p": 5e-324},
    {"temperature": 5e-324, "min_p": 1.0}, {"presence_penalty": -2, "frequency_penalty": -2},
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_extreme_sampling_values_keep_to_the_grammar(server, path, extreme):
    """Each value in its range, however small: the output is still one of the choices, and
    (three in a row, with no other request between) the engine keeps serving."""
    ask = {"prompt": "yes or no? yes no yes"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "yes or no? yes no yes"}]}
    for _ in range(3):
        r = httpx.post(server.url + path, timeout=60, json=ask | extreme | {
            "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice.get("text", choice.get("message", {}).get("content")) in ("yes", "no")
    assert httpx.get(server.url + "/health/ready").status_code == 200


@pytest.mark.parametrize("body,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "'uniqueItems' at #"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objectx"}}}}, "Unsupported type"),
    ({"response_format": {"type": "xml"}}, "not one of text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex cannot be used"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "grammar cannot be used"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "not both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {}}}}}}]}, "'not' at"),
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
])
def test_invalid_constraints_get_a_400_before_generation(server, body, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert "/project/" not in r.text and ".cc:" not in r.text


def call_args(message, skip_last: bool = False) -> list[tuple[str, dict]]:
    calls = []
    for call in (message.tool_calls or [])[:-1 if skip_last else None]:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        assert call.type == "function" and call.id.startswith("call_")
        calls.append((call.function.name, args))
    return calls


def reassemble(stream) -> tuple[str, list[tuple[str, str]], str]:
    """OpenAI-style tool-call deltas -> (content, [(name, arguments)], finish_reason)."""
    content, calls, ids, finish = "", {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id:
                ids[d.index] = d.id
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][1] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice,names", [
    ("required", None),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_forced_tool_calls_round_trip_streamed_or_not(client, choice, names):
    for seed in (4, 5):
        kw = dict(model=None, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
                  temperature=1.0, seed=seed, parallel_tool_calls=False)
        out = client.chat.completions.create(**kw)
        message = out.choices[0].message
        calls = call_args(message)
        assert calls and out.choices[0].finish_reason == "tool_calls"
        assert message.content is None
        if names:
            assert {name for name, _ in calls} <= names
        content, streamed, finish = reassemble(client.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls" and not content.strip()
        assert [(n, json.loads(a)) for n, a in streamed] == calls


def test_parallel_calls_come_back_as_several(client):
    """The random model never chooses to stop, so it calls until max_tokens: every call but a
    cut-off last one is complete and valid, each with its own id."""
    out = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, seed=7,
                                         tool_choice="required", max_tokens=150,
                                         temperature=1.0)
    choice = out.choices[0]
    calls = call_args(choice.message, skip_last=choice.finish_reason == "length")
    assert len(calls) >= 2
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_tool_choice_none_and_auto_streamed_or_not(client, choice):
    kw = dict(model=None, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=12,
              temperature=0)
    out = client.chat.completions.create(**kw).choices[0]
    if choice == "none":
        assert out.message.tool_calls is None and out.message.content
    calls = call_args(out.message, skip_last=out.finish_reason == "length")
    content, streamed, finish = reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == out.finish_reason
    assert content.strip() == (out.message.content or "").strip()
    assert [(n, json.loads(a)) for n, a in streamed[:len(calls)]] == calls


def test_tool_results_are_rendered_in_later_turns(client, server):
    first = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=200, seed=6,
                                           temperature=1.0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(model=None, messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    text = httpx.post(server.url + "/detokenize", json={"tokens": httpx.post(
        server.url + "/tokenize", json={"messages": history}).json()["tokens"]}).json()["prompt"]
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert f'"name": "{call.function.name}"' in text and "<tool_call>" in text


def test_compilation_happens_off_the_engine_thread_and_is_cached(server):
    compiled = server.engine.core.grammars.compiled
    constraint = Constraint.json_schema(SCHEMAS[1]["schema"])
    compiled._cache.pop(constraint, None)  # (an earlier test may have compiled it)
    threads = []
    real = compiled._fn

    def spy(constraint):
        threads.append(threading.current_thread().name)
        return real(constraint)

    compiled._fn = spy
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[1]["schema"]}}
        for _ in range(2):
            r = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": ASK, "response_format": fmt, "max_tokens": 300}, timeout=60)
            assert r.status_code == 200
    finally:
        compiled._fn = real
    assert len(threads) == 1 and threads[0].startswith("ember-compile")  # the repeat: cached
    assert constraint in compiled
