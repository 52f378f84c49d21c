"""JSON Schema (a practical subset) and "any JSON object" as regexes of `regex_dfa`'s subset, so
that structured output runs through the same constraint compiler, bounds and caches as a
client's ``regex``.

Output is compact JSON (no whitespace between tokens). Supported keywords:

* ``type``: ``object`` (``properties``, ``required``, ``additionalProperties``), ``array``
  (``items``, ``minItems``, ``maxItems``), ``string`` (``minLength``, ``maxLength``),
  ``integer``, ``number``, ``boolean``, ``null``, or a list of these;
* ``enum`` and ``const`` of JSON scalars;
* annotations, ignored: ``title``, ``description``, ``$schema``, ``$id``, ``default``,
  ``examples``, ``strict``.

An object's members are written in the order of ``properties``, every one of them (optional
ones too, which a valid answer may hold); no others, whatever ``additionalProperties`` says
(answers stay valid either way). Strings hold no control characters and the escapes
``\\" \\\\ \\/ \\n \\t`` only. Anything else (``$ref``, ``anyOf``, ``pattern``, ``format``,
...) raises `SchemaError` naming the keyword's path, so a client learns what is not honoured
instead of getting answers that ignore it.

``json_object`` (`ANY_OBJECT`): an object whose values nest at most two levels, with strings
without escapes and numbers without exponents (a regex cannot count brackets, and this one must
fit the default regex size cap; richer JSON needs a schema).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 8  # nesting of schemas inside schemas
MAX_ITEMS = 1000  # regex_dfa's largest repeat count

# One JSON string character: not a quote, backslash or control character; or a short escape.
_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/nt])'
STRING = f'"{_CHAR}*"'
INTEGER = r"-?(?:0|[1-9]\d{0,15})"
NUMBER = INTEGER + r"(?:\.\d{1,16})?(?:[eE][+-]?\d{1,3})?"
BOOLEAN = "(?:true|false)"
NULL = "null"

_ANNOTATIONS = frozenset(
    {"title", "description", "$schema", "$id", "$comment", "default", "examples", "strict"}
)
_KEYWORDS: dict[str, frozenset[str]] = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "string": frozenset({"minLength", "maxLength"}),
    "integer": frozenset(),
    "number": frozenset(),
    "boolean": frozenset(),
    "null": frozenset(),
}
_KNOWN = _ANNOTATIONS.union({"type", "enum", "const"}, *_KEYWORDS.values())
_REGEX_SPECIAL = frozenset(".^$*+?{}[]\\|()/-")


class SchemaError(ValueError):
    """A schema outside the supported subset; ``path`` is the JSON path of the keyword."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def _group(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _list(item: str, low: int = 0, high: int | None = None) -> str:
    """``[item,item,...]`` with ``low`` to ``high`` items."""
    if high == 0:
        return r"\[\]"
    if low == 0:
        tail = "*" if high is None else f"{{0,{high - 1}}}"
        return rf"\[(?:{item}(?:,{item}){tail})?\]"
    tail = f"{{{low - 1},}}" if high is None else f"{{{low - 1},{high - 1}}}"
    return rf"\[{item}(?:,{item}){tail}\]"


def _members(key: str, value: str) -> str:
    """``{key:value,...}`` with any number of members."""
    return rf"\{{(?:{key}:{value}(?:,{key}:{value})*)?\}}"


# "Any JSON object" must fit a regex's default size cap (1024 characters): its strings take
# no escapes and its numbers no exponent, and it nests two levels.
_PLAIN_STRING = r'"[^"\\\x00-\x1f]*"'
_PLAIN_SCALAR = rf"(?:{_PLAIN_STRING}|-?(?:0|[1-9]\d*)(?:\.\d+)?|true|false|null)"
_NESTED = f"(?:{_PLAIN_SCALAR}|{_list(_PLAIN_SCALAR)}|{_members(_PLAIN_STRING, _PLAIN_SCALAR)})"
ANY_OBJECT = _members(_PLAIN_STRING, _NESTED)


def literal(text: str) -> str:
    """``text`` matched literally."""
    out = []
    for ch in text:
        if ch in _REGEX_SPECIAL:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _json_literal(value: Any, path: str) -> str:
    if isinstance(value, dict | list):
        raise SchemaError(path, "enum and const values must be strings, numbers, booleans or null")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # the model writes 2 for 2.0
    return literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _count(schema: Mapping[str, Any], name: str, path: str, default: int | None) -> int | None:
    value = schema.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ITEMS:
        raise SchemaError(f"{path}.{name}", f"must be an integer in 0..{MAX_ITEMS}")
    return value


def schema_regex(schema: Any, path: str = "schema", depth: int = 0) -> str:
    """The regex of the compact JSON texts valid under ``schema``; `SchemaError` naming the
    path of the first keyword outside the subset."""
    if not isinstance(schema, Mapping):
        raise SchemaError(path, "must be a JSON object (a schema)")
    if depth > MAX_DEPTH:
        raise SchemaError(path, f"schemas nest at most {MAX_DEPTH} levels")
    for key in schema:  # an unknown keyword first: it is what the client must change
        if key not in _KNOWN:
            raise SchemaError(f"{path}.{key}"[:200], "is not supported by this server")
    if "enum" in schema or "const" in schema:
        return _enum(schema, path)
    kind = schema.get("type")
    if kind is None:
        raise SchemaError(f"{path}.type", "is required (or enum / const)")
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or any(k not in _KEYWORDS for k in kinds):
        raise SchemaError(f"{path}.type", f"must be one of {', '.join(_KEYWORDS)} (or a list)")
    allowed = _ANNOTATIONS.union({"type"}, *(_KEYWORDS[k] for k in kinds))
    for key in schema:
        if key not in allowed:
            raise SchemaError(f"{path}.{key}"[:200], f"does not apply to type {kind}")
    return _group([_typed(schema, k, path, depth) for k in dict.fromkeys(kinds)])


def _enum(schema: Mapping[str, Any], path: str) -> str:
    for key in schema:
        if key not in _ANNOTATIONS | {"enum", "const", "type"}:
            raise SchemaError(f"{path}.{key}"[:200], "is not supported beside enum / const")
    if "const" in schema:
        return _json_literal(schema["const"], f"{path}.const")
    values = schema["enum"]
    if not isinstance(values, list) or not values:
        raise SchemaError(f"{path}.enum", "must be a non-empty array")
    return _group([_json_literal(v, f"{path}.enum[{i}]") for i, v in enumerate(values)])


def _typed(schema: Mapping[str, Any], kind: str, path: str, depth: int) -> str:
    if kind == "string":
        low = _count(schema, "minLength", path, 0) or 0
        high = _count(schema, "maxLength", path, None)
        if high is not None and high < low:
            raise SchemaError(f"{path}.maxLength", "is below minLength")
        if low == 0 and high is None:
            return STRING
        return f'"{_CHAR}{{{low},{"" if high is None else high}}}"'
    if kind == "integer":
        return INTEGER
    if kind == "number":
        return NUMBER
    if kind == "boolean":
        return BOOLEAN
    if kind == "null":
        return NULL
    if kind == "array":
        if "items" not in schema:
            raise SchemaError(f"{path}.items", "is required for an array")
        item = schema_regex(schema["items"], f"{path}.items", depth + 1)
        low = _count(schema, "minItems", path, 0) or 0
        high = _count(schema, "maxItems", path, None)
        if high is not None and high < low:
            raise SchemaError(f"{path}.maxItems", "is below minItems")
        return _list(item, low, high)
    return _object(schema, path, depth)


def _object(schema: Mapping[str, Any], path: str, depth: int) -> str:
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        raise SchemaError(f"{path}.properties", "must be an object of schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or any(r not in properties for r in required):
        raise SchemaError(f"{path}.required", "must list names of properties")
    extra = schema.get("additionalProperties", False)
    if not isinstance(extra, bool):
        raise SchemaError(f"{path}.additionalProperties", "must be true or false")
    members = [
        _json_literal(name, f"{path}.properties")
        + ":"
        + schema_regex(sub, f"{path}.properties.{name}"[:200], depth + 1)
        for name, sub in properties.items()
    ]
    return r"\{" + ",".join(members) + r"\}"
