"""The load generator's HTTP client: the methods of `AsyncVisionLanguageClient` it uses, over
the server's HTTP door (Moondream's API, server-sent events), returning the same result types,
so one request loop measures both doors.

Pictures travel as base64 data URLs, as the official clients send them (encoded once per
distinct picture: the client's cost stays out of the server's figures). Segment answers carry
no polygons over HTTP (Moondream's API has none).
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import aiohttp
import grpc

from vlm_server.client import types as t

FINISH_REASONS = {"stop": "eos"}  # the door's names -> the gRPC client's


def _metrics(m: dict[str, Any]) -> t.Metrics:
    return t.Metrics(
        queue_wait_ms=m.get("queue_time_ms", 0.0),
        time_to_first_token_ms=m.get("ttft_ms", 0.0),
        prefill_ms=m.get("prefill_time_ms", 0.0),
        decode_ms=m.get("decode_time_ms", 0.0),
        total_ms=m.get("total_time_ms", 0.0),
        input_tokens=m.get("input_tokens", 0),
        output_tokens=m.get("output_tokens", 0),
        cached_tokens=m.get("cached_tokens", 0),
        intake_ms=m.get("intake_time_ms", 0.0),
        prefix_wait_ms=m.get("prefix_wait_ms", 0.0),
    )


def _finish(answer: dict[str, Any]) -> str:
    reason = str(answer.get("finish_reason", ""))
    return FINISH_REASONS.get(reason, reason)


def _error(payload: Any, status: int) -> t.VlmError:
    error = payload.get("error", {}) if isinstance(payload, dict) else {}
    name = str(error.get("code", ""))
    code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    message = str(error.get("message", f"HTTP {status}"))
    request_id = payload.get("request_id") if isinstance(payload, dict) else None
    return t.VlmError(code, message, error.get("field"), request_id)


class HttpLoadClient:
    """``base_url`` is the API root, e.g. ``http://127.0.0.1:2020/v1``."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[int, tuple[bytes, str]] = {}

    async def __aenter__(self) -> HttpLoadClient:
        # No connection limit: the load generator decides the concurrency.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _data_url(self, image: bytes) -> str:
        known = self._urls.get(id(image))
        if known is None or known[0] is not image:
            known = (image, "data:image/jpeg;base64," + base64.b64encode(image).decode())
            self._urls[id(image)] = known
        return known[1]

    async def _post(
        self, path: str, body: dict[str, Any], timeout: float | None
    ) -> aiohttp.ClientResponse:
        assert self._session is not None, "use the client as `async with`"
        response = await self._session.post(
            f"{self.base_url}{path}",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
        )
        if response.status != 200:
            payload = await response.json(content_type=None)
            response.release()
            raise _error(payload, response.status)
        return response

    async def _unary(
        self, path: str, body: dict[str, Any], timeout: float | None
    ) -> dict[str, Any]:
        response = await self._post(path, body, timeout)
        async with response:
            return dict(await response.json())

    async def _text_stream(
        self, path: str, body: dict[str, Any], timeout: float | None
    ) -> AsyncIterator[t.TextDelta | t.TextResult]:
        response = await self._post(path, {**body, "stream": True}, timeout)
        text: list[str] = []
        async with response:
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise _error(event, 200)
                if event.get("completed"):
                    yield t.TextResult("".join(text), _finish(event), _metrics(event["metrics"]))
                    return
                if "reasoning_chunk" in event:
                    yield t.TextDelta(event["reasoning_chunk"], reasoning=True)
                    continue
                text.append(event["chunk"])
                yield t.TextDelta(event["chunk"])

    def _body(self, image: bytes | None, settings: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"settings": settings}
        if image is not None:
            body["image_url"] = self._data_url(image)
        return body

    def query_stream(
        self,
        image: bytes | None,
        question: str,
        timeout: float | None = None,
        reasoning: bool = False,
        regex: str | None = None,
        **settings: Any,
    ) -> AsyncIterator[t.TextDelta | t.TextResult]:
        body = {**self._body(image, settings), "question": question}
        if reasoning:
            body["reasoning"] = True
        if regex is not None:
            body["regex"] = regex
        return self._text_stream("/query", body, timeout)

    def caption_stream(
        self, image: bytes, length: str = "normal", timeout: float | None = None, **settings: Any
    ) -> AsyncIterator[t.TextDelta | t.TextResult]:
        body = {**self._body(image, settings), "length": length}
        return self._text_stream("/caption", body, timeout)

    async def point(
        self, image: bytes, obj: str, timeout: float | None = None, **settings: Any
    ) -> t.PointResult:
        a = await self._unary("/point", {**self._body(image, settings), "object": obj}, timeout)
        points = [t.Point(p["x"], p["y"]) for p in a["points"]]
        return t.PointResult(points, _finish(a), _metrics(a["metrics"]))

    async def detect(
        self, image: bytes, obj: str, timeout: float | None = None, **settings: Any
    ) -> t.DetectResult:
        a = await self._unary("/detect", {**self._body(image, settings), "object": obj}, timeout)
        boxes = [t.Box(b["x_min"], b["y_min"], b["x_max"], b["y_max"]) for b in a["objects"]]
        return t.DetectResult(boxes, _finish(a), _metrics(a["metrics"]))

    async def segment(
        self, image: bytes, obj: str, timeout: float | None = None, **settings: Any
    ) -> t.SegmentResult:
        a = await self._unary("/segment", {**self._body(image, settings), "object": obj}, timeout)
        b = a.get("bbox") or {"x_min": 0.0, "y_min": 0.0, "x_max": 0.0, "y_max": 0.0}
        box = t.Box(b["x_min"], b["y_min"], b["x_max"], b["y_max"])
        mask = t.RleMask([], 0, 0)
        return t.SegmentResult(box, a["path"], [], mask, _finish(a), _metrics(a["metrics"]))
