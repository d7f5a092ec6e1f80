"""Tool calling: the prompt side, the grammar side and the parsing side.

The call format (the Hermes / Qwen2.5 one, on one line; docs/tools.md):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

The grammar keeps a call on one line so that no control character is ever legal inside it
(xgrammar lets some through in length-bounded strings; ember bans them inside calls). The
parser also reads calls written with newlines, as Qwen-style templates show them.

A chat template that knows tools (it mentions `tools`) gets them and renders calls and results
itself. For one that does not (SmolLM2's), ember adds a system message that lists the tools and
shows the format, writes earlier calls back in that format, and wraps tool results in
<tool_response> tags.

Grammar: tool_choice "required" or a named function allows nothing but calls; "auto" allows
free text until "<tool_call>" appears, then the call's JSON must match that function's
parameter schema (an xgrammar structural tag). `parallel_tool_calls=false` stops after one.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ember.constraint import Constraint, check_schema
from ember.errors import InvalidRequest

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = "}" + CALL_END   # what closes a call after its arguments


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool definitions -> their `function` parts, checked."""
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': "
                                 "{'name': ..., 'parameters': {...}}}", param=f"tools.{i}")
        check_schema(fn.get("parameters", {"type": "object"}), f"tools[{i}].parameters")
        functions.append(fn)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    return functions


def _tag(fn: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tag", "begin": f'{CALL_START}{{"name": {json.dumps(fn["name"])}, '
                                    '"arguments": ',
            "content": {"type": "json_schema", "max_whitespace_cnt": 1,
                        "json_schema": fn.get("parameters") or {"type": "object"}},
            "end": _TAIL}


def tool_constraint(functions: list[dict[str, Any]], tool_choice: Any,
                    parallel: bool) -> Constraint | None:
    """The structural tag for a tool choice (None for "none")."""
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if tool_choice.get("type") != "function" or not chosen:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among "
                                 "the tools", param="tool_choice")
        functions, tool_choice = chosen, "required"
    elif tool_choice not in ("auto", "required", None):
        raise InvalidRequest(f"tool_choice {tool_choice!r} is not one of none, auto, required, "
                             "or {'type': 'function', 'function': {'name': ...}}",
                             param="tool_choice")
    tags = [_tag(f) for f in functions]
    if tool_choice == "required":
        # no separator: after a call the model must either start the next one or stop (with
        # a newline allowed there, small models tend to repeat the same call forever)
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "",
               "at_least_one": True, "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_START], "tags": tags,
               "at_least_one": False, "stop_after_first": not parallel}
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def tool_system_prompt(functions: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                    "parameters": f.get("parameters", {})}) for f in functions)
    return ("You can call functions. These are available:\n" + listing + "\n\nTo call one, "
            f"reply with exactly:\n{CALL_START}{{\"name\": <function name>, \"arguments\": "
            f"<JSON object>}}{CALL_END}\nUse one block per call. After the results come "
            "back, answer the user.")


def render_for_plain_template(messages: list[dict[str, Any]],
                              functions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools listed in the system message,
    earlier calls written in the call format, results wrapped in <tool_response>."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f'{CALL_START}{{"name": {json.dumps(c["function"]["name"])}, '
                      f'"arguments": {c["function"]["arguments"]}}}{CALL_END}'
                      for c in m["tool_calls"]]
            out.append({"role": "assistant",
                        "content": "\n".join(([m["content"]] if m.get("content") else [])
                                             + blocks)})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if functions:
        prompt = tool_system_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    """Splits streamed text into content and tool calls, incrementally.

    feed() returns events as soon as they are certain: ("content", text),
    ("call", index, ToolCall) when a call's name is known, ("arguments", index, text) for
    each further piece of its arguments. Text that might still turn into a call marker is
    held back until the next feed or finish().
    """

    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "text"          # text | header | arguments

    def feed(self, text: str) -> list[tuple]:
        self._buffer += text
        events: list[tuple] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple]:
        """Flush what is left: an unfinished marker or header is plain content after all."""
        events: list[tuple] = []
        if self._state == "arguments":
            self._emit_arguments(events, self._buffer.rstrip().removesuffix("}"))
        elif self._buffer:
            prefix = CALL_START if self._state == "header" else ""
            events.append(("content", prefix + self._buffer))
        self._buffer, self._state = "", "text"
        return events

    def _step(self, events: list[tuple]) -> bool:
        buf = self._buffer
        if self._state == "text":
            start = buf.find(CALL_START)
            if start < 0:
                safe = len(buf) - _partial_suffix(buf, CALL_START)
                if safe:
                    events.append(("content", buf[:safe]))
                self._buffer = buf[safe:]
                return False
            if start:
                events.append(("content", buf[:start]))
            self._buffer, self._state = buf[start + len(CALL_START):], "header"
            return True
        if self._state == "header":
            match = _HEADER.match(buf)
            if match is None:
                return False
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{match.group(1)}"'))
            self.calls.append(call)
            events.append(("call", len(self.calls) - 1, call))
            self._buffer, self._state = buf[match.end():], "arguments"
            return True
        end = buf.find(CALL_END)
        if end < 0:  # hold back what may be the closing "}" and tag
            self._emit_arguments(events, buf[:max(0, len(buf) - len(_TAIL) - 2)])
            return False
        self._emit_arguments(events, buf[:end].rstrip().removesuffix("}").rstrip())
        self._buffer, self._state = buf[end + len(CALL_END):].lstrip("\n"), "text"
        return True

    def _emit_arguments(self, events: list[tuple], arguments: str) -> None:
        call = self.calls[-1]
        new = arguments.lstrip()[len(call.arguments):]
        if new:
            call.arguments += new
            events.append(("arguments", len(self.calls) - 1, new))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
