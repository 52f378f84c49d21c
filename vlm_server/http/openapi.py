"""The OpenAPI 3.1 description of the HTTP door, generated from its route table."""

from __future__ import annotations

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


def _operation(route: Route) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": route.response or {}}}
    if route.streams:
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": "server-sent events (with stream: true)"}
        }
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    if route.task is not None:
        for status, text in _ERRORS.items():
            responses[status] = {
                "description": text,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": route.path.strip("/").replace("/", "_").replace(".", "_"),
        "tags": [route.tag],
        "responses": responses,
    }
    if route.task is not None:
        op["parameters"] = _HEADERS
        op["security"] = [{"moondreamKey": []}, {"bearer": []}, {}]
    if route.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": json_schema(route.request)}},
        }
    return op


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
