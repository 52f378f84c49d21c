"""The OpenAI chat parameters that shape an answer: ``stop`` and ``response_format``.

``response_format`` becomes the query's ``regex`` constraint, so it runs through the same
constraint compiler, with the same bounds (pattern size, automaton states, compile time), as a
client's own regex: ``json_object`` is `decoding.json_schema.ANY_OBJECT`, ``json_schema`` the
pattern of its ``schema`` (the subset `decoding.json_schema` documents; anything else is a 400
naming the keyword).
"""

from __future__ import annotations

from typing import Any

from decoding.json_schema import ANY_OBJECT, SchemaError, schema_regex
from vlm_server.frontend.refusals import invalid
from vlm_server.http.body import Field, check

MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
FIELD = "response_format"

STOP_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS},
    ]
}
_JSON_SCHEMA = (
    Field("name", "string", "A name for the schema.", required=True),
    Field("description", "string", "What the schema is for."),
    Field("schema", "object", "The JSON Schema (a subset: see decoding/json_schema.py)."),
    Field("strict", "boolean", "Accepted; answers always follow the schema."),
)
RESPONSE_FORMAT = (
    Field(
        "type",
        "string",
        "text, json_object or json_schema.",
        required=True,
        enum=("text", "json_object", "json_schema"),
    ),
    Field("json_schema", "object", "The schema of a json_schema answer.", fields=_JSON_SCHEMA),
)


def stop_sequences(value: Any) -> tuple[str, ...]:
    """The ``stop`` parameter as a tuple of sequences (a string is one sequence)."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for s in stops:
        if not s:
            raise invalid("stop", "a stop sequence must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise invalid("stop", f"a stop sequence is at most {MAX_STOP_CHARS} characters")
    return tuple(stops)


def response_regex(value: Any, max_chars: int) -> str | None:
    """The regex an answer in ``response_format`` must match (None: free text).

    ``max_chars``: the server's regex size cap (0: none), checked here so that the error
    names this parameter and says what to change."""
    if value is None:
        return None
    fmt = check(RESPONSE_FORMAT, value, FIELD)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        pattern = ANY_OBJECT
    else:
        spec = fmt.get("json_schema")
        if spec is None or spec.get("schema") is None:
            raise invalid(f"{FIELD}.json_schema.schema", "is required for a json_schema format")
        where = f"{FIELD}.json_schema"
        try:
            pattern = schema_regex(spec["schema"], "schema")
        except SchemaError as err:
            raise invalid(f"{where}.{err.path}", err.message) from None
    if max_chars and len(pattern) > max_chars:
        raise invalid(
            FIELD,
            f"the format compiles to a pattern of {len(pattern)} characters; the server takes "
            f"at most {max_chars} (--max-regex-chars): simplify the schema",
        )
    return pattern
