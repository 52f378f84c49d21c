"""Errors over HTTP: status codes mapped from the service's codes, one JSON shape for all.

Every error body is ``{"error": {"code", "message", "field"}}``: ``code`` is the gRPC status
name the gRPC door would answer with, ``field`` the request field at fault (or null). The
shared validation names proto fields; `rename` turns them into the names a route's clients
sent (``image_bytes`` -> ``image_url``), in the field and at the head of the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlm_server.engine.api import EngineError, ErrorCode
from vlm_server.frontend.refusals import proto_field

STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.OUT_OF_RANGE: 422,  # well-formed, but beyond the model (e.g. its context)
    ErrorCode.RESOURCE_EXHAUSTED: 429,  # queue full: retry later
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.CANCELLED: 499,  # nobody reads it: the client has gone
    ErrorCode.UNIMPLEMENTED: 501,
    ErrorCode.INTERNAL: 500,
}


class HttpError(EngineError):
    """An error with an HTTP status of its own (e.g. 413), counted under ``code``; ``name``
    replaces the code's name in the body where gRPC has no such code (401, 404)."""

    def __init__(
        self,
        status: int,
        code: ErrorCode,
        message: str,
        field: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(code, message, field)
        self.status = status
        self.name = name or code.value


def unauthenticated(message: str) -> HttpError:
    return HttpError(401, ErrorCode.INVALID_ARGUMENT, message, name="UNAUTHENTICATED")


def not_found(path: str) -> HttpError:
    message = f"no route {path[:200]} (see /openapi.json)"
    return HttpError(404, ErrorCode.UNIMPLEMENTED, message, name="NOT_FOUND")


# Fields whose RESOURCE_EXHAUSTED passes: no adapter slot came free in time (429, retry).
_TRANSIENT = {"adapter", "settings.adapter"}


def status_of(err: EngineError) -> int:
    if isinstance(err, HttpError):
        return err.status
    if err.code is ErrorCode.RESOURCE_EXHAUSTED and err.field and err.field not in _TRANSIENT:
        return 413  # this request can never fit (e.g. beyond the KV cache); retrying won't help
    return STATUS.get(err.code, 500)


def rename(err: EngineError, names: Mapping[str, str]) -> HttpError:
    """``err`` naming its field as this route's clients call it, in the field and at the head
    of the message (engines name `GenerationRequest` fields, validation the proto's)."""
    field = proto_field(err.field)
    new = names.get(field, field) if field is not None else None
    message = err.message
    for old in (err.field, field):
        if old and new and message.startswith(f"{old}:"):
            message = new + message[len(old) :]
            break
    return HttpError(status_of(err), err.code, message, new, name=_name(err))


def _name(err: EngineError) -> str:
    return err.name if isinstance(err, HttpError) else err.code.value


def body(err: EngineError, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON error object of a `rename`d error; ``extra`` adds members (e.g. OpenAI's
    ``type`` and ``param``)."""
    error: dict[str, Any] = {"code": _name(err), "message": err.message, "field": err.field}
    if extra:
        error.update(extra)
    return {"error": error}
