"""Engine errors -> gRPC status codes, and the field names clients see."""

from __future__ import annotations

import grpc

from vlm_server.engine.api import EngineError, ErrorCode

FIELD_METADATA_KEY = "vlm-field"
REQUEST_ID_METADATA_KEY = "vlm-request-id"

STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

# Engines name fields after `GenerationRequest`; clients know the proto's names.
_PROTO_FIELDS = {
    "temperature": "settings.temperature",
    "top_p": "settings.top_p",
    "max_tokens": "settings.max_tokens",
    "max_objects": "settings.max_objects",
    "seed": "settings.seed",
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
