"""The OpenAPI 3.1 description of the HTTP door, generated from its route table."""

from __future__ import annotations

import re
from typing import Any

from vlm_server.http.body import json_schema
from vlm_server.http.exchange import REQUEST_ID_HEADER
from vlm_server.http.routes import Route

AUTH_HEADER = "X-Moondream-Auth"
TIMEOUT_HEADER = "X-Request-Timeout"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "the gRPC status name"},
                "message": {"type": "string"},
                "field": {"type": ["string", "null"], "description": "the field at fault"},
            },
            "required": ["code", "message", "field"],
        },
        "request_id": {"type": "string"},
    },
}
_ERRORS = {
    "400": "Bad input; the message and field name what is wrong",
    "401": "Missing or wrong API key (when the server requires one)",
    "413": "Body larger than the server's limit, or a request larger than the KV cache",
    "422": "Well-formed but beyond the model (e.g. prompt plus max_tokens beyond its context)",
    "429": "Queue full; retry later",
    "501": "Not implemented by the serving engine",
    "503": "Model loading or server draining; retry elsewhere",
    "504": "Deadline (X-Request-Timeout) exceeded",
}
# The answers of a keyed route (no engine request: files and batches).
_KEYED_ERRORS = {
    "400": "Bad input; the message and field name what is wrong",
    "401": "Missing or wrong API key (when the server requires one)",
    "404": "No such object (another API key's objects are absent too)",
    "409": "The object is in a state that does not allow it",
    "413": "Larger than the server's limit",
    "501": "Not available on this server (the message names the option that turns it on)",
}
_HEADERS = [
    {
        "name": REQUEST_ID_HEADER,
        "in": "header",
        "required": False,
        "description": "Your id for the request (echoed back); the server makes one otherwise.",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,64}$"},
    },
    {
        "name": TIMEOUT_HEADER,
        "in": "header",
        "required": False,
        "description": "Deadline in seconds; the request ends with 504 when it passes.",
        "schema": {"type": "number", "exclusiveMinimum": 0},
    },
]


def _parameters(route: Route) -> list[dict[str, Any]]:
    """The path's ``{name}`` parameters, then the query's."""
    out: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", route.path)
    ]
    for field in route.query:
        schema = json_schema(field)
        description = schema.pop("description")
        out.append(
            {
                "name": field.name,
                "in": "query",
                "required": field.required,
                "description": description,
                "schema": schema,
            }
        )
    return out


def _operation(route: Route) -> dict[str, Any]:
    content: dict[str, Any] = {route.media: {"schema": route.response or {}}}
    if route.streams:
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": "server-sent events (with stream: true)"}
        }
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    errors = _ERRORS if route.task is not None else _KEYED_ERRORS if route.keyed else {}
    for status, text in errors.items():
        responses[status] = {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": _operation_id(route),
        "tags": [route.tag],
        "responses": responses,
    }
    parameters = _parameters(route) + (_HEADERS if route.task is not None else [])
    if parameters:
        op["parameters"] = parameters
    if route.task is not None or route.keyed:
        op["security"] = [{"moondreamKey": []}, {"bearer": []}, {}]
    if route.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": json_schema(route.request)}},
        }
    elif route.body is not None:
        op["requestBody"] = {"required": True, "content": route.body}
    return op


def _operation_id(route: Route) -> str:
    """Unique per method and path: ``/v1/files/{file_id}`` -> ``get_v1_files_file_id``."""
    path = re.sub(r"[^A-Za-z0-9]+", "_", route.path).strip("_")
    # A keyed path may take several methods; the others keep the ids they always had.
    return f"{route.method.lower()}_{path}" if route.keyed else path


def document(routes: tuple[Route, ...], version: str) -> dict[str, Any]:
    """The OpenAPI document describing exactly ``routes``."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "moondream-serve HTTP API",
            "version": version,
            "description": "Moondream's API (compatible with the official moondream clients) "
            "and an OpenAI-compatible chat endpoint, in front of the same engine as the gRPC "
            "service. Pictures travel inline as base64 data URLs; coordinates are normalized "
            "to the picture with the origin top-left (detect and segment boxes may extend "
            "past it unless settings.clip is set).",
        },
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR_SCHEMA},
            "securitySchemes": {
                "moondreamKey": {"type": "apiKey", "in": "header", "name": AUTH_HEADER},
                "bearer": {"type": "http", "scheme": "bearer"},
            },
        },
    }
