"""The gateway's HTTP door: every request passed on to the HTTP door of the replica its body's
affinity key picks (`http_keys.body_key`), the answer streamed back as it comes.

The replica's door answers exactly as a single server does (routes, errors, server-sent
events, API keys). A client that goes away closes the upstream request, which cancels the
engine request. A replica that refuses the connection (its process is gone) is marked down
and the request goes to another, as does one a replica refused for now (429: its queue or
adapter slots full) while another replica is left; no replica at all is 503 in the door's
error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web

from vlm_server.cluster.http_keys import body_key
from vlm_server.cluster.replica_set import NoReplica, Replica, ReplicaSet
from vlm_server.engine.api import EngineError, ErrorCode
from vlm_server.http.body import too_large
from vlm_server.http.error_bodies import HttpError, body, status_of

log = logging.getLogger(__name__)

# Hop-by-hop headers and those the new message sets itself (RFC 9110 7.6.1).
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
}
_KEY_ON_LOOP_BYTES = 1 << 20  # larger bodies are parsed for their key in a thread
_CHUNK = 1 << 16
_LOST = "the replica serving this request stopped; retry (another replica takes it)"


def _error(err: EngineError) -> web.Response:
    return web.json_response(body(err), status=status_of(err))


class HttpGateway:
    """The aiohttp application of the door and its pooled upstream session."""

    def __init__(self, replicas: ReplicaSet, max_body_bytes: int) -> None:
        self.replicas = replicas
        self._limit = max_body_bytes
        self._session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._active = 0  # requests being answered: a drain waits for them
        self._idle = asyncio.Event()
        self._idle.set()
        self.port = 0

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        # No total timeout: a long caption streams as long as it takes; the replica's door
        # bounds each request.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )
        # Handler cancellation: a client that goes away cancels its upstream request at once.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=reuse_port or None)
        await site.start()
        self._site = site
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop taking connections; requests in flight get ``grace`` seconds to finish."""
        try:
            if self._site is not None:
                await self._site.stop()  # the listener: no new connections
                self._site = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def _body(self, request: web.Request) -> bytes | None:
        """The body, or None once it is larger than the limit."""
        if request.content_length is not None and request.content_length > self._limit:
            return None
        data = bytearray()
        while chunk := await request.content.read(_CHUNK):
            data += chunk
            if len(data) > self._limit:
                return None
        return bytes(data)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self._active += 1
        self._idle.clear()
        try:
            return await self._route(request)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _route(self, request: web.Request) -> web.StreamResponse:
        data = await self._body(request)
        if data is None:
            return _error(too_large(self._limit))
        key = None
        if data:
            if len(data) > _KEY_ON_LOOP_BYTES:
                key = await asyncio.to_thread(body_key, data)
            else:
                key = body_key(data)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        tried: set[str] = set()
        while True:
            try:
                routed = self.replicas.route(key, frozenset(tried))
            except NoReplica:
                return _error(HttpError(503, ErrorCode.UNAVAILABLE, "no replica is serving"))
            replica = routed.replica
            busy_retry = any(r.name not in tried | {replica.name} for r in self.replicas.serving())
            try:
                if replica.http:
                    answer = await self._pass(request, replica, data, headers, busy_retry)
                    if answer is not None:
                        return answer
                    tried.add(replica.name)  # busy for now: another replica takes it
                    continue
            except aiohttp.ClientConnectorError:
                log.warning("replica %s unreachable at %s", replica.name, replica.http)
            except aiohttp.ClientError as err:  # lost before it answered
                log.warning("replica %s lost: %s", replica.name, err)
                return _error(HttpError(503, ErrorCode.UNAVAILABLE, _LOST))
            finally:
                self.replicas.done(routed)
            tried.add(replica.name)
            self.replicas.unreachable(replica)

    async def _pass(
        self,
        request: web.Request,
        replica: Replica,
        data: bytes,
        headers: dict[str, str],
        busy_retry: bool,
    ) -> web.StreamResponse | None:
        """The replica's answer, streamed to the client; None (nothing sent) when the replica
        refused for now (429: its queue or adapter slots full) and ``busy_retry``."""
        assert self._session is not None
        url = f"http://{replica.http}{request.path_qs}"
        async with self._session.request(
            request.method, url, data=data, headers=headers
        ) as upstream:
            if upstream.status == 429 and busy_retry:
                return None
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers.add(name, value)
            try:
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                # The replica went away mid-answer: cut the client's answer there too, so it
                # cannot pass for a whole one.
                log.warning("replica %s lost mid-answer", replica.name)
                upstream.close()
                if request.transport is not None:
                    request.transport.close()
                return response
            except BaseException:  # the client left: closing upstream cancels the request
                upstream.close()
                raise
            await response.write_eof()
            return response
