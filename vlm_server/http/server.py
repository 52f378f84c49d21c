"""The HTTP door: an aiohttp server on the gRPC server's event loop, over the same core.

Every engine route runs inside a shared `Call` (admission: 503 while loading or draining; the
door's metrics and access log) under the request's deadline (``X-Request-Timeout`` seconds:
504 when it passes). A client that disconnects cancels its handler (aiohttp's handler
cancellation), which cancels the engine request and frees its pages. Auth is pluggable: a
callable that says whether a key (``X-Moondream-Auth`` or ``Authorization: Bearer``) is
valid; None leaves the door open. The server assembly may add routes of the floors above
(the Batch API's files and batches): keyed ones take the API key, whose identity owns what
they create.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from vlm_server.engine.api import EngineError, ErrorCode
from vlm_server.frontend.api_keys import ANONYMOUS, ApiKeys
from vlm_server.frontend.calls import Call, Door, ServiceCore, request_id
from vlm_server.frontend.phase import ServerPhase
from vlm_server.frontend.refusals import invalid
from vlm_server.http import error_bodies, openapi
from vlm_server.http.dispatch import answer
from vlm_server.http.exchange import REQUEST_ID_HEADER, Exchange
from vlm_server.http.probes import HEALTH
from vlm_server.http.routes import OPENAPI, ROUTES, Route

log = logging.getLogger(__name__)

Authorizer = Callable[[str], bool]
ANY_FREE_PORT = -1
_STOP_GRACE_S = 1.0


def _deadline(header: str | None) -> float | None:
    """Seconds from now in the timeout header -> a ``time.monotonic()`` deadline."""
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        message = f"must be a positive number of seconds, got {header!r:.40}"
        raise invalid(openapi.TIMEOUT_HEADER, message)
    return time.monotonic() + seconds


def _api_key(request: web.Request) -> str | None:
    key = request.headers.get(openapi.AUTH_HEADER)
    if key:
        return key
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


class HttpFrontDoor:
    """Moondream's API and the OpenAI-compatible endpoints in front of ``core``."""

    def __init__(
        self,
        core: ServiceCore,
        max_body_bytes: int,
        authorize: Authorizer | None = None,
        version: str = "unknown",
        health: ServerPhase | None = None,
        extra_routes: tuple[Route, ...] = (),
    ) -> None:
        self.core = core
        self.max_body_bytes = max_body_bytes
        self.authorize = authorize
        self.routes = ROUTES + extra_routes
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._json_errors])
        self.app[OPENAPI] = openapi.document(self.routes, version)
        self.app[HEALTH] = health or ServerPhase()  # /health and /ready read it
        for route in self.routes:
            self.app.router.add_route(route.method, route.path, self._handler(route))
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (`ANY_FREE_PORT`: one the system picks); the bound port."""
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, max(port, 0), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        # Handler cancellation: a client that goes away cancels its request at once.
        runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=_STOP_GRACE_S
        )
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner
        self.port = int(sock.getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Close the listener and the connections left (call after the drain)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _check_key(self, request: web.Request) -> None:
        if self.authorize is None:
            return
        key = _api_key(request)
        if key is None:
            raise error_bodies.unauthenticated(
                f"an API key is required: send it in {openapi.AUTH_HEADER} or as "
                "Authorization: Bearer"
            )
        if not self.authorize(key):
            raise error_bodies.unauthenticated("the API key is not valid")

    def _owner(self, request: web.Request) -> str:
        """Check the key; who owns what the request creates (without keys: one owner)."""
        self._check_key(request)
        key = _api_key(request)
        return ANONYMOUS if self.authorize is None or key is None else ApiKeys.identity(key)

    async def _keyed(self, route: Route, ex: Exchange) -> web.StreamResponse:
        """A keyed route: the key checked, errors answered as an engine route's are."""
        try:
            ex.owner = self._owner(ex.request)
            return await route.handler(ex)
        except EngineError as err:
            return await ex.fail(err)
        except Exception:
            log.exception("%s %s failed (request id %s)", route.method, route.path, ex.request_id)
            message = f"internal error (request id {ex.request_id})"
            return await ex.fail(EngineError(ErrorCode.INTERNAL, message))

    def _handler(self, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            rid = request_id(request.headers.get(REQUEST_ID_HEADER))
            if route.keyed:
                return await self._keyed(route, Exchange(request, None, rid, self.max_body_bytes))
            if route.task is None:
                return await route.handler(Exchange(request, None, rid, self.max_body_bytes))
            try:
                self._check_key(request)
                deadline = _deadline(request.headers.get(openapi.TIMEOUT_HEADER))
            except EngineError as err:
                return await Exchange(request, None, rid, self.max_body_bytes).fail(err)
            call = Call(self.core, Door.HTTP, route.task, rid, request.remote or "", deadline)
            return await answer(
                route, Exchange(request, call, rid, self.max_body_bytes), call, deadline
            )

        return handle

    @web.middleware
    async def _json_errors(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """aiohttp's own errors (unknown path, wrong method) as JSON errors too."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            rid = request_id(request.headers.get(REQUEST_ID_HEADER))
            ex = Exchange(request, None, rid, self.max_body_bytes)
            if exc.status == 404:
                err: EngineError = error_bodies.not_found(request.path)
            else:
                name = exc.reason.upper().replace(" ", "_")  # e.g. METHOD_NOT_ALLOWED
                code = ErrorCode.INVALID_ARGUMENT
                err = error_bodies.HttpError(exc.status, code, exc.reason, name=name)
            response = await ex.fail(err)
            if exc.status == 405:
                response.headers["Allow"] = exc.headers.get("Allow", "")
            return response
