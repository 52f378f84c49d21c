"""Request bodies: read within a size limit, parse as JSON, check against a declared shape.

A route declares its body as `Field`s; `check` enforces the declared JSON types, refuses unknown
fields and the official API's knobs this model lacks (each error names the field's path), and
`json_schema` turns the same declaration into the OpenAPI schema, so the two cannot drift.
Value ranges and limits are not checked here: the shared validation of the service does that.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vlm_server.engine.api import ErrorCode
from vlm_server.frontend.refusals import invalid
from vlm_server.http import json_body
from vlm_server.http.error_bodies import HttpError

_CHUNK = 1 << 16
BODY = "body"  # the field name of errors about the body as a whole
# A member's name as errors show it; any other (empty, spaces, quotes) is shown JSON-quoted.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_\-]+")

_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@dataclass(frozen=True)
class Field:
    """One member of a JSON object: its JSON type (``any``: the handler checks it) and meaning.

    ``unsupported`` marks a knob of the official API that this model lacks: sending it with any
    value but ``unsupported_ok`` is an error that says so, instead of being silently ignored."""

    name: str
    type: str
    description: str
    required: bool = False
    enum: tuple[str, ...] = ()
    fields: tuple[Field, ...] = ()  # members of an object
    items: Field | None = None  # elements of an array
    schema: Mapping[str, Any] | None = None  # the OpenAPI schema of an ``any`` field
    unsupported: str = ""
    unsupported_ok: tuple[Any, ...] = (None, False)


def too_large(limit: int) -> HttpError:
    message = f"{BODY}: the request body is larger than the server's limit of {limit} bytes"
    return HttpError(413, ErrorCode.RESOURCE_EXHAUSTED, message, BODY)


async def read_json(request: web.BaseRequest, limit: int) -> Any:
    """The parsed JSON body; 413 before reading a body whose declared length is too large, or
    as soon as an undeclared (chunked) one goes beyond ``limit``."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit)
    # The chunks are joined where the body is parsed: growing one buffer here would copy all
    # of it on the event loop each time the buffer moved.
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(_CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
    if not size:
        raise invalid(BODY, "the request has no body; send a JSON object")
    # Bounded in depth, values and event-loop time (json_body.py).
    return await json_body.parse_body(chunks)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    for name in ("boolean", "string", "integer", "number", "object", "array"):
        if isinstance(value, _PYTHON_TYPES[name]):
            return name
    return type(value).__name__


def _check_value(spec: Field, value: Any, path: str) -> None:
    if spec.type == "any":
        return
    ok = isinstance(value, _PYTHON_TYPES[spec.type])
    if spec.type in ("number", "integer") and isinstance(value, bool):
        ok = False  # JSON true is not 1
    if ok and isinstance(value, float) and not math.isfinite(value):
        # JSON has no infinity: the parser made one of a number beyond a double (1e999).
        raise invalid(path, "must be a finite number, got one beyond the range of a double")
    if not ok:
        raise invalid(path, f"must be a JSON {spec.type}, got {_type_name(value)}")
    if spec.enum and value not in spec.enum:
        raise invalid(path, f"must be one of {', '.join(spec.enum)}, got {value!r:.40}")
    if spec.type == "object" and spec.fields:
        check(spec.fields, value, path)
    if spec.type == "array" and spec.items is not None:
        for i, item in enumerate(value):
            _check_value(spec.items, item, f"{path}[{i}]")


def check(fields: tuple[Field, ...], body: Any, prefix: str = "") -> dict[str, Any]:
    """``body`` checked against ``fields``; returns it (a dict) with every member present."""
    where = prefix or BODY
    if not isinstance(body, dict):
        raise invalid(where, f"must be a JSON object, got {_type_name(body)}")
    known = {f.name: f for f in fields}
    for key in body:
        if key not in known:
            name = key if _PLAIN_NAME.fullmatch(key) else json.dumps(key)[:60]  # "", "a b"
            path = f"{prefix}.{name}" if prefix else name
            raise invalid(path[:120], "unknown field (see /openapi.json)")
    for spec in fields:
        path = f"{prefix}.{spec.name}" if prefix else spec.name
        value = body.get(spec.name)
        if spec.unsupported and value not in spec.unsupported_ok:
            raise invalid(path, spec.unsupported)
        if value is None:
            if spec.required:
                raise invalid(path, "is required")
            continue
        _check_value(spec, value, path)
    return body


def json_schema(spec: Field | tuple[Field, ...]) -> dict[str, Any]:
    """The JSON schema (OpenAPI 3.1 flavour) of a field, or of an object made of ``fields``."""
    if isinstance(spec, tuple):
        out: dict[str, Any] = {
            "type": "object",
            "additionalProperties": False,
            "properties": {f.name: json_schema(f) for f in spec},
        }
        required = [f.name for f in spec if f.required]
        if required:
            out["required"] = required
        return out
    if spec.schema is not None:
        out = dict(spec.schema)
    elif spec.type == "object" and spec.fields:
        out = json_schema(spec.fields)
    elif spec.type == "any":
        out = {}
    else:
        out = {"type": spec.type}
    if spec.items is not None:
        out["items"] = json_schema(spec.items)
    if spec.enum:
        out["enum"] = list(spec.enum)
    description = spec.description
    if spec.unsupported:
        description = f"{description} Not supported by this server: {spec.unsupported}"
    out["description"] = description
    return out
