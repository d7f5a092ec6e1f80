"""Structured output on the shipped model: every output parses and validates.

Reference: `jsonschema` for schemas, `re.fullmatch` for regexes, the grammar's own language.
A corpus of schemas (nested objects, arrays, enums, bounded numbers, required fields, $ref)
x greedy and two seeds at temperature 0.8.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from ember import InvalidRequest, SamplingParams
from ember.constraint import Constraint

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "schemas.json").read_text())
SAMPLERS = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=0.8, seed=2)]


@pytest.fixture(scope="module")
def prompt(smollm_llm):
    return lambda text: smollm_llm.chat_prompt([{"role": "user", "content": text}])


@pytest.mark.heavy   # every schema with every sampler: the tests below cover each kind
def test_every_output_validates_against_its_schema(smollm_llm, prompt):
    prompts, params, cases = [], [], []
    for case in SCHEMAS:
        for sampler in SAMPLERS:
            prompts.append(prompt(f"Describe a {case['name']} as JSON."))
            params.append(SamplingParams(max_tokens=300, constraint=Constraint.json_schema(
                case["schema"]), **sampler))
            cases.append(case)
    for case, out in zip(cases, smollm_llm.generate(prompts, params)):
        o = out.outputs[0]
        assert o.finish_reason.value == "stop", (case["name"], o.text)
        jsonschema.validate(json.loads(o.text), case["schema"])


def test_json_object_regex_choice_and_grammar(smollm_llm, prompt):
    cases = [
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (Constraint("regex", r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (Constraint.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (Constraint("grammar", 'root ::= color | color ", " color | color ", " color ", " '
                               'color\ncolor ::= "red" | "green" | "blue"'),
         lambda t: re.fullmatch(r"(red|green|blue)(, (red|green|blue)){0,2}", t)),
        (Constraint("lark", 'start: "x" /[0-9]{1,3}/ ("+" /[0-9]{1,3}/)?'),
         lambda t: re.fullmatch(r"x\d{1,3}(\+\d{1,3})?", t)),
    ]
    for constraint, check in cases:
        for sampler in SAMPLERS[:2]:
            out = smollm_llm.generate([prompt("Give a short answer.")], SamplingParams(
                max_tokens=200, constraint=constraint, **sampler))[0].outputs[0]
            assert out.finish_reason.value == "stop", (constraint.kind, out.text)
            assert check(out.text), (constraint.kind, out.text)


def test_a_bad_grammar_is_refused_before_generation(smollm_llm, prompt):
    with pytest.raises(InvalidRequest, match="grammar cannot be used"):
        smollm_llm.generate([prompt("x")], SamplingParams(
            constraint=Constraint("grammar", "root ::= undefined_rule")))
    with pytest.raises(InvalidRequest, match="json schema cannot be used"):
        smollm_llm.generate([prompt("x")], SamplingParams(
            constraint=Constraint.json_schema({"type": "objectx"})))
    assert not smollm_llm.engine.has_unfinished()


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(smollm_llm, prompt):
    out = smollm_llm.generate([prompt("Pick one.")], SamplingParams(
        max_tokens=50, min_tokens=20, ignore_eos=True, temperature=0,
        constraint=Constraint.choice(["yes", "no"])))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason.value == "stop"


def test_auto_tool_choice_is_free_text_until_a_call_starts(smollm_llm):
    """The auto grammar lets any text through, then holds a started call to the tools."""
    from ember.sampling.grammar import Matcher
    from ember.server.tools import check_tools, tool_constraint
    functions = check_tools([{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}}}])
    compiled = smollm_llm.engine.grammars.compile(tool_constraint(functions, "auto", True))
    encode = lambda text: smollm_llm.tokenizer.encode(text, add_special_tokens=False)  # noqa

    def accepts(text: str) -> bool:
        matcher = Matcher(compiled)
        return all(matcher.accept(t) for t in encode(text))

    assert accepts("Any text at all, even {json} or <b>tags</b>.\n")
    assert accepts('Sure. <tool_call>{"name": "add", "arguments": {"a": 5}}</tool_call> More.')
    assert not accepts('Sure. <tool_call>{"name": "sub", "arguments": {"a": 5}}</tool_call>')
    assert not accepts('<tool_call>{"name": "add", "arguments": {"a": "five"}}</tool_call>')
