"""One HTTP request on its way through the door: its shared `Call`, its body, its response.

A route handler gets an `Exchange`: it reads the checked JSON body (`json`), runs the engine
through ``call``, and answers with `respond` or, for a stream, `stream` (server-sent events).
Errors are the door's: a handler raises `EngineError`, and `fail` answers with a JSON error
object, or with an error event when the stream has already begun.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from vlm_server.engine.api import EngineError, ErrorCode
from vlm_server.frontend.calls import Call
from vlm_server.http import body, error_bodies

REQUEST_ID_HEADER = "X-Request-Id"
ErrorStyle = Callable[[EngineError], dict[str, Any]]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class EventStream:
    """A ``text/event-stream`` response: one ``data:`` line per event."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    async def send(self, event: Any) -> None:
        """Send a JSON event (or a raw string such as ``[DONE]``)."""
        data = event.encode() if isinstance(event, str) else dumps(event)
        try:
            await self.response.write(b"data: " + data + b"\n\n")
        except ConnectionError:
            # Writing after the client left: end the request like a cancel (pages are freed
            # by the engine stream's cancel on the way out).
            raise EngineError(ErrorCode.CANCELLED, "the client closed the connection") from None

    async def close(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.response.write_eof()


class Exchange:
    """What a route handler works with. ``call`` is None on routes that need no engine."""

    def __init__(
        self,
        request: web.Request,
        call: Call | None,
        request_id: str,
        max_body_bytes: int,
    ) -> None:
        self.request = request
        self.call = call
        self.request_id = request_id
        self.max_body_bytes = max_body_bytes
        # Proto field path -> the name this route's clients use (errors speak their language).
        self.names: dict[str, str] = {}
        self.error_style: ErrorStyle = error_bodies.body
        self.events: EventStream | None = None
        # Who sent it, on keyed routes (the server's HTTP door sets it): an API key's
        # identity, or the one anonymous owner when the server takes no keys.
        self.owner = ""

    @property
    def active_call(self) -> Call:
        assert self.call is not None, "this route runs no engine request"
        return self.call

    async def json(self, fields: tuple[body.Field, ...]) -> dict[str, Any]:
        """The request body, read within the size limit and checked against ``fields``."""
        return body.check(fields, await body.read_json(self.request, self.max_body_bytes))

    def headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.request_id}

    def respond(self, payload: Any, status: int = 200) -> web.Response:
        return web.Response(
            body=dumps(payload),
            status=status,
            content_type="application/json",
            headers=self.headers(),
        )

    async def stream(self) -> EventStream:
        """Begin a 200 event stream (headers go out now: later errors become events)."""
        response = web.StreamResponse(
            headers={
                **self.headers(),
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must pass events on at once
            }
        )
        await response.prepare(self.request)
        self.events = EventStream(response)
        return self.events

    def error_body(self, err: EngineError) -> dict[str, Any]:
        return {**self.error_style(err), "request_id": self.request_id}

    async def fail(self, err: EngineError) -> web.StreamResponse:
        """Answer ``err``: a JSON error with its status, or an error event on a begun stream."""
        named = error_bodies.rename(err, self.names)
        if self.events is None:
            response = self.respond(self.error_body(named), named.status)
            if named.status in (429, 503):
                response.headers["Retry-After"] = "1"
            return response
        if named.code is not ErrorCode.CANCELLED:
            with contextlib.suppress(EngineError):  # the client may have gone too
                await self.events.send(self.error_body(named))
        await self.events.close()
        return self.events.response
