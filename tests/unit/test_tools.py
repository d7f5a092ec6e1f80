"""The tool-call parser and prompt rendering (reference: the call format in tools.py and
OpenAI's message shapes)."""
from __future__ import annotations

import json

import pytest

from ember.errors import InvalidRequest
from ember.server.tools import (ToolCallParser, check_tools, render_for_plain_template,
                                tool_constraint)

TEXT = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "c"}}</tool_call><tool_call>\n{"name": "add", "arguments": {"a": 1, '
        '"b": 2}}\n</tool_call> Done.')


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    content, args = "", {}
    for piece in pieces:
        for event in parser.feed(piece):
            content, args = apply(event, content, args)
    for event in parser.finish():
        content, args = apply(event, content, args)
    return content, [(c.name, args[i]) for i, c in enumerate(parser.calls)]


def apply(event, content, args):
    if event[0] == "content":
        return content + event[1], args
    if event[0] == "call":
        args[event[1]] = ""
    else:
        args[event[1]] += event[2]
    return content, args


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_incremental_parsing_equals_whole_parsing(size):
    content, calls = run(ToolCallParser(), [TEXT[i:i + size] for i in range(0, len(TEXT), size)])
    assert content == "Let me check.  Done."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]


def test_text_that_only_looks_like_a_call_stays_content():
    content, calls = run(ToolCallParser(), ["a <tool", "_ca", "x> b <tool_call>not json"])
    assert calls == [] and content == "a <tool_cax> b <tool_call>not json"


def test_plain_templates_get_tools_calls_and_results_written_in():
    functions = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object"}}}])
    messages = render_for_plain_template([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}], functions)
    assert messages[0]["role"] == "system" and '"name": "f"' in messages[0]["content"]
    assert messages[0]["content"].startswith("Be brief.")
    assert messages[2] == {"role": "assistant",
                           "content": '<tool_call>{"name": "f", "arguments": {}}</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_tool_choices_build_the_right_structures():
    functions = check_tools([{"type": "function", "function": {"name": n}} for n in "ab"])
    assert tool_constraint(functions, "none", True) is None
    auto = json.loads(tool_constraint(functions, "auto", True).spec)["format"]
    assert auto["type"] == "triggered_tags" and not auto["at_least_one"]
    named = json.loads(tool_constraint(functions, {"type": "function", "function": {
        "name": "b"}}, False).spec)["format"]
    assert named["type"] == "tags_with_separator" and named["at_least_one"]
    assert named["stop_after_first"] and len(named["tags"]) == 1
    assert '"name": "b"' in named["tags"][0]["begin"]
    with pytest.raises(InvalidRequest, match="'maybe' is not one of"):
        tool_constraint(functions, "maybe", True)
    with pytest.raises(InvalidRequest, match="unique"):
        check_tools([{"type": "function", "function": {"name": "a"}}] * 2)
