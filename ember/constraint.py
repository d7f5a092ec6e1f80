"""What a structured output must match: plain data, checked when built (no grammar engine
here; ember/sampling/grammar.py compiles it)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "grammar", "lark", "choice", "structural_tag")

# JSON Schema keywords xgrammar enforces. Others (not, if/then/else, contains, uniqueItems,
# allOf of several schemas, ...) it would silently let through, so they are refused.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum",
    "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
    "format", "minItems", "maxItems", "minProperties", "maxProperties", "patternProperties",
    "title", "description", "default", "examples", "$schema", "$id", "$comment"})
# keywords whose value is a map of names to schemas, or a list of schemas
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `spec` is text: a schema or tag as JSON, a regex, a
    grammar, or the choices as a JSON list."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"constraint kind {self.kind!r} is unknown; use one of "
                                 f"{', '.join(KINDS)}", param="structured_outputs")

    @classmethod
    def json_schema(cls, schema: Any) -> "Constraint":
        check_schema(schema)
        return cls("json_schema", json.dumps(schema))  # key order kept: the output follows it

    @classmethod
    def choice(cls, choices: list[str]) -> "Constraint":
        if not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequest("choice needs a non-empty list of strings",
                                 param="structured_outputs.choice")
        return cls("choice", json.dumps(choices))


def check_schema(schema: Any, path: str = "#") -> None:
    """Refuse what cannot be enforced, naming where it is: nothing is silently ignored."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequest(f"the JSON schema at {path} must be an object or a boolean",
                             param="response_format")
    unknown = sorted(set(schema) - SCHEMA_KEYWORDS)
    if unknown:
        raise InvalidRequest(f"JSON Schema keyword {unknown[0]!r} at {path} is not supported "
                             f"(ember enforces: {', '.join(sorted(SCHEMA_KEYWORDS))})",
                             param="response_format")
    if len(schema.get("allOf", [])) > 1:
        raise InvalidRequest(f"allOf with more than one schema at {path} is not supported; "
                             "merge the schemas", param="response_format")
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            check_schema(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            check_schema(sub, f"{path}/{key}/{i}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            check_schema(schema[key], f"{path}/{key}")


