"""The OpenAI batch file format: one request a line in, one result a line out.

An input line is ``{"custom_id", "method", "url", "body"}``; its ``url`` names one of the HTTP
door's engine routes and its ``body`` is what that route takes (never a stream). An output line
is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``: a line
the route answered carries its answer (an error answer too, with its status); a line that never
reached a route (not JSON, a missing field, an unknown url) has ``response`` null and ``error``
naming its cause.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

# The routes a batch line may name: every engine route of the HTTP door that takes a body.
BATCH_URLS = (
    "/v1/caption",
    "/v1/query",
    "/v1/point",
    "/v1/detect",
    "/v1/segment",
    "/v1/chat/completions",
)
MAX_CUSTOM_ID_CHARS = 512


class LineError(ValueError):
    """A line that cannot run; ``code`` is the output line's ``error.code``, ``field`` the
    member at fault (``line`` for the line as a whole)."""

    def __init__(self, message: str, field: str = "line", code: str = "invalid_request") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


@dataclass(frozen=True)
class BatchRequest:
    """One input line, checked: ``url`` is one of `BATCH_URLS`."""

    custom_id: str
    url: str
    body: dict[str, Any]
    method: str = "POST"

    def to_json(self) -> str:
        line = {"custom_id": self.custom_id, "method": self.method, "url": self.url}
        return json.dumps({**line, "body": self.body}, ensure_ascii=False)


def custom_id_of(text: str) -> str | None:
    """The ``custom_id`` of a line, when it has a usable one (an error line still names it)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_CUSTOM_ID_CHARS else None


def parse_line(text: str) -> BatchRequest:
    """Check one input line; `LineError` names the member at fault."""
    try:
        obj = json.loads(text)
    except ValueError as err:
        raise LineError(f"line: not JSON ({err})") from None
    if not isinstance(obj, dict):
        raise LineError(f"line: must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("custom_id: required, a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(f"custom_id: longer than {MAX_CUSTOM_ID_CHARS} characters", "custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(f"method: must be POST, got {method!r:.40}", "method")
    url = obj.get("url")
    if url not in BATCH_URLS:
        raise LineError(f"url: must be one of {', '.join(BATCH_URLS)}; got {url!r:.80}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("body: required, a JSON object", "body")
    if body.get("stream"):
        raise LineError("body.stream: a batch request answers once; it cannot stream", "body")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(f"{unknown[0]}: not a member of a batch request line", unknown[0])
    return BatchRequest(custom_id, url, body, method)


def _line_id() -> str:
    return "batch_req_" + uuid.uuid4().hex[:24]


def answered(custom_id: str, status: int, body: Any, request_id: str) -> dict[str, Any]:
    """The output line of a request a route answered (with its answer or its error)."""
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": None}


def failed(custom_id: str, err: LineError) -> dict[str, Any]:
    """The output line of a line that never reached a route."""
    error = {"code": err.code, "message": str(err), "field": err.field}
    return {"id": _line_id(), "custom_id": custom_id, "response": None, "error": error}


def succeeded(line: dict[str, Any]) -> bool:
    """Whether an output line is a success (OpenAI's output file; the rest: its error file)."""
    response = line.get("response")
    return (
        line.get("error") is None
        and isinstance(response, dict)
        and (200 <= int(response.get("status_code", 0)) < 300)
    )
