"""``GET /health`` (liveness) and ``GET /ready`` (readiness): the gRPC health service's two
states over HTTP, for orchestrators and load balancers that probe with plain HTTP.

``/health`` is 200 while the process can serve (loading, serving, draining) and 503 once the
engine has failed or the server has stopped: restart it. ``/ready`` is 200 only while the model
is loaded and the server is not draining: send it work. Both answer ``{"status", "phase"}``
(``status`` as gRPC health names it), need no API key, and run no engine request.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vlm_server.http.exchange import Exchange
from vlm_server.rpc.health import HealthState

HEALTH = web.AppKey("health", HealthState)

PROBE_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["SERVING", "NOT_SERVING"]},
        "phase": {
            "type": "string",
            "enum": ["loading", "serving", "draining", "failed", "stopped"],
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
