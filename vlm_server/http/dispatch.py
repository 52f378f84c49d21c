"""Running one engine route inside its `Call`: admission, the deadline, and every error turned
into the route's answer. The HTTP door runs each request through `answer`; so do the batch
runners, whose requests arrive as lines of a file instead of over a connection."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from vlm_server.engine.api import EngineError, ErrorCode
from vlm_server.frontend.calls import Call
from vlm_server.http import openapi
from vlm_server.http.exchange import Exchange
from vlm_server.http.routes import Route


async def answer(
    route: Route, ex: Exchange, call: Call, deadline: float | None
) -> web.StreamResponse:
    """Run ``route`` for ``ex`` within ``call``; an error becomes an error answer (a bug: 500
    naming the request id only, logged by the call)."""
    try:
        return await _run(route, ex, call, deadline)
    except EngineError as err:
        return await ex.fail(err)
    except Exception:
        internal = EngineError(ErrorCode.INTERNAL, f"internal error (request id {call.request_id})")
        return await ex.fail(internal)


async def _run(
    route: Route, ex: Exchange, call: Call, deadline: float | None
) -> web.StreamResponse:
    async with call:
        call.engine()  # 503 at once while loading or draining: the body is never read
        if deadline is None:
            return await route.handler(ex)
        # The loop's clock is time.monotonic(), the deadline's clock.
        when = asyncio.get_running_loop().time() + (deadline - time.monotonic())
        try:
            async with asyncio.timeout_at(when):
                return await route.handler(ex)
        except TimeoutError:
            raise EngineError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the deadline ({openapi.TIMEOUT_HEADER}) passed",
            ) from None
