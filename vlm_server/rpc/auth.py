"""API keys: who may call, and who a caller is (for per-client quotas).

`ApiKeys` (vlm_server/frontend/api_keys.py) is the one key check both doors use; here a
caller sends ``authorization: Bearer KEY``.
`AuthInterceptor` refuses every gRPC call without a valid key with UNAUTHENTICATED, except
the health service (load balancers probe it without credentials).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from vlm_server.frontend.api_keys import ApiKeys

AUTHORIZATION_KEY = "authorization"
_BEARER = "bearer "
OPEN_SERVICES = ("grpc.health.v1.Health",)

Metadata = Sequence[tuple[str, str | bytes]]
RejectHook = Callable[[str, grpc.StatusCode, str], None]


def bearer_token(metadata: Metadata | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` entry, if any."""
    for name, value in metadata or ():
        if name.lower() != AUTHORIZATION_KEY:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if text[: len(_BEARER)].lower() == _BEARER:
            return text[len(_BEARER) :].strip()
    return None


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7`` (each connection has its own port)."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


def client_identity(keys: ApiKeys | None, metadata: Metadata | None, peer: str) -> str:
    """Who a call comes from: its API key when keys are on, else its peer's address."""
    token = bearer_token(metadata) if keys is not None else None
    if token is not None and keys is not None and keys(token):
        return ApiKeys.identity(token)
    return peer_host(peer)


def _service(method: str) -> str:
    return method.lstrip("/").split("/", 1)[0]


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without parsing input."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await deny(request, context)
        yield  # never reached: abort raises; an async generator, as streaming handlers are

    ignore: Callable[[bytes], None] = lambda _data: None
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    behavior = deny_stream if handler.response_streaming else deny
    return make(behavior, request_deserializer=ignore)  # type: ignore[operator]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without a valid bearer key (health stays open)."""

    def __init__(self, keys: ApiKeys, on_reject: RejectHook | None = None) -> None:
        self.keys = keys
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or _service(details.method) in OPEN_SERVICES:
            return handler
        token = bearer_token(details.invocation_metadata)
        if self.keys(token):
            return handler
        message = (
            "missing API key: send 'authorization: Bearer KEY'"
            if token is None
            else "invalid API key"
        )
        if self._on_reject is not None:
            self._on_reject(details.method, grpc.StatusCode.UNAUTHENTICATED, message)
        return _refusal(handler, message)
