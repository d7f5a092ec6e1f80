"""Constraints refuse what cannot be enforced, naming it (reference: the keyword list)."""
from __future__ import annotations

import re

import pytest

from ember.constraint import Constraint, check_schema
from ember.errors import InvalidRequest


@pytest.mark.parametrize("schema,where", [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at #"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     "'not' at #/properties/a"),
    ({"anyOf": [{"type": "string"}, {"if": {}, "then": {}}]}, "'if' at #/anyOf/1"),
    ({"$defs": {"x": {"contains": {"const": 1}}}, "$ref": "#/$defs/x"},
     "'contains' at #/$defs/x"),
    ({"type": "array", "items": {"type": "object", "dependentRequired": {}}},
     "'dependentRequired' at #/items"),
])
def test_unenforceable_keywords_are_refused_by_name_and_place(schema, where):
    with pytest.raises(InvalidRequest, match=re.escape(where)):
        check_schema(schema)


def test_several_all_of_schemas_are_refused():
    with pytest.raises(InvalidRequest, match="allOf with more than one"):
        check_schema({"allOf": [{"type": "integer"}, {"minimum": 3}]})


def test_supported_schemas_pass_and_keep_their_key_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": [1]}},
              "required": ["b"], "additionalProperties": False}
    assert Constraint.json_schema(schema).spec.index('"b"') < \
        Constraint.json_schema(schema).spec.index('"a"')
    check_schema(True)
    with pytest.raises(InvalidRequest, match="must be an object"):
        check_schema([1, 2])


def test_kinds_and_choices_are_checked():
    with pytest.raises(InvalidRequest, match="unknown"):
        Constraint("xml")
    with pytest.raises(InvalidRequest, match="non-empty list of strings"):
        Constraint.choice([])
