"""The route table of the HTTP door: what `server` registers and `openapi` describes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vlm_server.engine.api import Task
from vlm_server.http import chat, moondream, probes
from vlm_server.http.body import Field
from vlm_server.http.exchange import Exchange

Handler = Callable[[Exchange], Awaitable[web.StreamResponse]]
OPENAPI = web.AppKey("openapi", dict)
OPENAPI_PATH = "/openapi.json"


@dataclass(frozen=True)
class Route:
    """One endpoint. ``task`` labels its metrics and access log; None: no engine request (no
    admission, no metrics). ``streams``: it may answer with server-sent events. ``keyed``: a
    route with no engine request that still takes the API key, whose holder owns what it
    creates (`Exchange.owner`); its `EngineError`s become error answers as an engine route's
    do. ``body`` describes a request body that is not JSON fields (OpenAPI content by media
    type), ``query`` the query parameters, ``media`` the answer's media type."""

    method: str
    path: str
    handler: Handler
    summary: str
    task: str | None
    request: tuple[Field, ...] | None = None
    response: dict[str, Any] | None = None
    streams: bool = False
    tag: str = "moondream"
    keyed: bool = False
    body: dict[str, Any] | None = None
    query: tuple[Field, ...] = ()
    media: str = "application/json"


async def _openapi(ex: Exchange) -> web.StreamResponse:
    return ex.respond(ex.request.app[OPENAPI])


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/caption",
        moondream.caption,
        "Describe a picture",
        Task.CAPTION,
        moondream.CAPTION,
        moondream.CAPTION_RESPONSE,
        streams=True,
    ),
    Route(
        "POST",
        "/v1/query",
        moondream.query,
        "Answer a question, about a picture or not",
        Task.QUERY,
        moondream.QUERY,
        moondream.QUERY_RESPONSE,
        streams=True,
    ),
    Route(
        "POST",
        "/v1/point",
        moondream.point,
        "Point at every instance of an object",
        Task.POINT,
        moondream.POINT,
        moondream.POINT_RESPONSE,
    ),
    Route(
        "POST",
        "/v1/detect",
        moondream.detect,
        "Box every instance of an object",
        Task.DETECT,
        moondream.DETECT,
        moondream.DETECT_RESPONSE,
    ),
    Route(
        "POST",
        "/v1/segment",
        moondream.segment,
        "Outline an object (an SVG path and its box)",
        Task.SEGMENT,
        moondream.SEGMENT,
        moondream.SEGMENT_RESPONSE,
        streams=True,
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        chat.completions,
        "OpenAI-compatible chat completion (one question, at most one picture)",
        Task.QUERY,
        chat.CHAT,
        chat.CHAT_RESPONSE,
        streams=True,
        tag="openai",
    ),
    Route(
        "GET",
        "/v1/models",
        chat.models,
        "OpenAI-compatible list of the served model",
        "model_info",
        response=chat.MODELS_RESPONSE,
        tag="openai",
    ),
    Route(
        "GET",
        "/health",
        probes.live,
        "Liveness: 503 once the engine failed or the server stopped (no API key needed)",
        None,
        response=probes.PROBE_RESPONSE,
        tag="meta",
    ),
    Route(
        "GET",
        "/ready",
        probes.ready,
        "Readiness: 200 only while the model is loaded and the server is not draining",
        None,
        response=probes.PROBE_RESPONSE,
        tag="meta",
    ),
    Route(
        "GET",
        OPENAPI_PATH,
        _openapi,
        "This description of the HTTP API",
        None,
        response={"type": "object"},
        tag="meta",
    ),
)
