"""``GET /health`` (liveness) and ``GET /ready`` (readiness): the server's phase
(frontend/phase.py), which the gRPC door reports as grpc.health.v1, over plain HTTP for
orchestrators and load balancers that probe that way.

``/health`` is 200 while the process can serve (loading, serving, draining) and 503 once the
engine has failed or the server has stopped: restart it. ``/ready`` is 200 only while the model
is loaded and the server is not draining: send it work. Both answer ``{"status", "phase"}``
(``status`` as gRPC health names it), need no API key, and run no engine request.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vlm_server.frontend.phase import PHASES, ServerPhase
from vlm_server.http.exchange import Exchange

HEALTH = web.AppKey("health", ServerPhase)

PROBE_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["SERVING", "NOT_SERVING"]},
        "phase": {
            "type": "string",
            "enum": list(PHASES),
        },
    },
}


def _answer(ex: Exchange, ok: bool) -> web.StreamResponse:
    health = ex.request.app[HEALTH]
    status = "SERVING" if ok else "NOT_SERVING"
    response = ex.respond({"status": status, "phase": health.phase}, 200 if ok else 503)
    response.headers["Cache-Control"] = "no-store"
    return response


async def live(ex: Exchange) -> web.StreamResponse:
    return _answer(ex, ex.request.app[HEALTH].live)


async def ready(ex: Exchange) -> web.StreamResponse:
    return _answer(ex, ex.request.app[HEALTH].ready)
