"""Refusals of a request, shared by both doors: EngineErrors that name the field at fault.

Validation names proto fields (``settings.temperature``); engines name `GenerationRequest`
fields (``temperature``). `proto_field` maps the latter to the former, which each door then
reports in its own way (gRPC: status and trailing metadata, vlm_server/rpc/status.py; HTTP:
vlm_server/http/error_bodies.py).
"""

from __future__ import annotations

from vlm_server.engine.api import EngineError, ErrorCode

# Engines name fields after `GenerationRequest`; clients know the proto's names.
_PROTO_FIELDS = {
    "temperature": "settings.temperature",
    "top_p": "settings.top_p",
    "max_tokens": "settings.max_tokens",
    "max_objects": "settings.max_objects",
    "seed": "settings.seed",
    "adapter": "settings.adapter",
    "priority": "settings.priority",
    "object_name": "object",
    "caption_length": "length",
}


def proto_field(name: str | None) -> str | None:
    """The request field (proto path) an engine's field name refers to."""
    if name is None:
        return None
    return _PROTO_FIELDS.get(name, name)


def invalid(field: str, message: str) -> EngineError:
    """An INVALID_ARGUMENT error whose message starts with the field's name."""
    return EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: {message}", field)


def unavailable(message: str) -> EngineError:
    return EngineError(ErrorCode.UNAVAILABLE, message)
