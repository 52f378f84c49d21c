"""Running one batch line through the HTTP door's own route handler, without a connection.

A line is answered exactly as the same body posted to its route would be (the same checks,
errors and answer), as a `Door.BATCH` request (its own metrics label). The exchange reads the
line's body instead of a request's and keeps the answer instead of sending it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vlm_server.bulk.lines import BATCH_URLS, BatchRequest
from vlm_server.frontend.calls import Call, Door, ServiceCore, request_id
from vlm_server.http import body as body_check
from vlm_server.http.dispatch import answer
from vlm_server.http.exchange import EventStream, Exchange
from vlm_server.http.routes import ROUTES, Route

ROUTE_OF: dict[str, Route] = {
    r.path: r for r in ROUTES if r.method == "POST" and r.path in BATCH_URLS
}


class LineExchange(Exchange):
    """An `Exchange` whose body is a batch line's and whose answer is kept, not sent."""

    def __init__(self, line_body: dict[str, Any], call: Call, rid: str) -> None:
        super().__init__(None, call, rid, 0)  # type: ignore[arg-type]  # no HTTP request
        self._line_body = line_body
        self.status = 0
        self.payload: Any = None

    async def json(self, fields: tuple[body_check.Field, ...]) -> dict[str, Any]:
        return body_check.check(fields, self._line_body)

    def respond(self, payload: Any, status: int = 200) -> web.Response:
        self.status, self.payload = status, payload
        return web.Response(status=status)

    async def stream(self) -> EventStream:  # lines are checked to ask for no stream
        raise AssertionError("a batch line cannot stream")


class LineRunner:
    """Runs batch lines on ``core``'s engine; ``priority`` (None: the line's own) is set on
    every line's body, so batch work can run below interactive traffic."""

    def __init__(self, core: ServiceCore, priority: int | None = None) -> None:
        missing = set(BATCH_URLS) - set(ROUTE_OF)
        assert not missing, f"batch urls without a route: {missing}"
        self.core = core
        self.priority = priority

    async def run(self, line: BatchRequest) -> tuple[int, Any, str]:
        """(status, JSON answer, request id) of one line."""
        route = ROUTE_OF[line.url]
        assert route.task is not None
        rid = request_id(None)
        line_body = line.body if self.priority is None else {**line.body, "priority": self.priority}
        call = Call(self.core, Door.BATCH, route.task, rid, "batch")
        ex = LineExchange(line_body, call, rid)
        await answer(route, ex, call, None)
        if ex.status == 0:  # every route answers through respond; guard a future one
            raise AssertionError(f"{line.url} answered without a body")
        return ex.status, ex.payload, rid
