"""JSON Schema (the supported subset) and "any JSON object" as regexes: what they accept is
compact JSON valid under the schema, they compile to small automata, and every keyword beyond
the subset is refused naming its path."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.json_schema import ANY_OBJECT, SchemaError, schema_regex
from decoding.regex_dfa import parse_regex, regex_dfa

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
        "kind": {"type": ["string", "null"]},
        "nested": {"type": "object", "properties": {"x": {"const": True}}},
    },
    "required": ["name", "age"],
    "title": "annotations are fine",
}


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_VALID = st.fixed_dictionaries(
    {
        "name": st.text(
            st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=8
        ),
        "age": st.integers(-(10**15), 10**15),
        "score": st.floats(-1e6, 1e6, allow_nan=False).map(lambda f: round(f, 3)),
        "ok": st.booleans(),
        "tags": st.lists(st.sampled_from(["a", "b", 3]), max_size=2),
        "kind": st.one_of(st.none(), st.text("xyz", max_size=3)),
        "nested": st.just({"x": True}),
    }
)


@settings(max_examples=200, deadline=None)
@given(_VALID)
def test_every_valid_instance_matches_the_schemas_regex(value: dict[str, Any]) -> None:
    ordered = {name: value[name] for name in SCHEMA["properties"]}  # members in schema order
    assert re.fullmatch(schema_regex(SCHEMA), _compact(ordered)) is not None


@pytest.mark.parametrize(
    "text",
    [
        '{"name":"","age":1,"score":1,"ok":true,"tags":[],"kind":null,"nested":{"x":true}}',
        '{"name":"a","age":1.5,"score":1,"ok":true,"tags":[],"kind":null,"nested":{"x":true}}',
        '{"name":"a","age":1,"score":1,"ok":1,"tags":[],"kind":null,"nested":{"x":true}}',
        '{"name":"a","age":1,"score":1,"ok":true,"tags":["c"],"kind":null,"nested":{"x":true}}',
        '{"name":"a","age":1,"score":1,"ok":true,"tags":[3,3,3],"kind":null,"nested":{"x":true}}',
        '{"name":"a","age":01,"score":1,"ok":true,"tags":[],"kind":null,"nested":{"x":true}}',
        '{"age":1,"name":"a","score":1,"ok":true,"tags":[],"kind":null,"nested":{"x":true}}',
    ],
)
def test_invalid_instances_do_not_match(text: str) -> None:
    assert re.fullmatch(schema_regex(SCHEMA), text) is None


def test_the_regexes_compile_to_small_automata() -> None:
    for pattern in (schema_regex(SCHEMA), ANY_OBJECT):
        dfa = regex_dfa(parse_regex(pattern), 4096)
        assert dfa.trans.shape[0] < 1000
    assert len(ANY_OBJECT) <= 1024  # fits the default --max-regex-chars


@pytest.mark.parametrize(
    "text",
    ["{}", '{"a":1}', '{"a":[1,"x",null],"b":{"c":true},"d":-0.5}', '{"a":{"b":"c"},"d":[]}'],
)
def test_any_object_accepts_objects(text: str) -> None:
    assert re.fullmatch(ANY_OBJECT, text) is not None


@pytest.mark.parametrize(
    "text", ["[]", '"a"', "{", '{"a":01}', '{"a":[[1]]}', '{"a":{"b":[]}}', "{'a':1}"]
)
def test_any_object_refuses_the_rest(text: str) -> None:
    assert re.fullmatch(ANY_OBJECT, text) is None


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "schema.properties.a.$ref"),
        ({"type": "string", "pattern": "a+"}, "schema.pattern"),
        ({"type": "string", "format": "date"}, "schema.format"),
        ({"anyOf": []}, "schema.anyOf"),
        ({"type": "tuple"}, "schema.type"),
        ({"type": "array"}, "schema.items"),
        ({"type": "string", "maxLength": 5000}, "schema.maxLength"),
        ({"type": "integer", "minItems": 2}, "schema.minItems"),
        ({"enum": [{"a": 1}]}, "schema.enum[0]"),
        ({"type": "object", "required": ["b"], "properties": {}}, "schema.required"),
        ([1, 2], "schema"),
    ],
)
def test_what_is_beyond_the_subset_is_refused_naming_its_path(schema: Any, path: str) -> None:
    with pytest.raises(SchemaError) as caught:
        schema_regex(schema)
    assert caught.value.path == path


def test_deep_schemas_are_refused() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(12):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nest at most"):
        schema_regex(schema)
