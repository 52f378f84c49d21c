"""The replica's HTTP ingress: Ray Serve's request, passed on to the replica's own HTTP door.

The door on loopback answers exactly as a single server does (routes, errors, server-sent
events, API keys); this only copies the request in and streams the answer back as it comes.
A client that goes away closes the stream, which closes the loopback request, which cancels
the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from vlm_server.cluster.gateway_http import HOP_BY_HOP
from vlm_server.http.body import too_large
from vlm_server.http.error_bodies import body as error_body
from vlm_server.http.error_bodies import status_of


class HttpForwarder:
    """Requests to ``http://<host>:<port>``, over one pooled session."""

    def __init__(self, host: str, port: int, max_body_bytes: int) -> None:
        self._base = f"http://{host}:{port}"
        self._limit = max_body_bytes
        # No total timeout: a long caption streams for as long as it takes; the door's own
        # limits bound a request.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )

    async def forward(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await self._body(request)
        if body is None:  # as the door answers it, without holding more than the limit
            err = too_large(self._limit)
            return JSONResponse(error_body(err), status_code=status_of(err))
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self._session.request(
            request.method, self._base + path, data=body, headers=headers
        )
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}

        async def chunks() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in upstream.content.iter_any():
                    yield chunk
                done = True
            finally:
                # Finished: the connection goes back to the pool. Cut short (the client left):
                # closing it is what tells the door to cancel the engine request.
                upstream.release() if done else upstream.close()

        return StreamingResponse(chunks(), status_code=upstream.status, headers=out_headers)

    async def _body(self, request: Request) -> bytes | None:
        """The body, or None once it is larger than the door's limit."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._limit:
            return None
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self._limit:
                return None
        return bytes(data)

    async def close(self) -> None:
        await self._session.close()
