"""The gateway's gRPC door: every API method passed on, as bytes, to the replica its request's
affinity key picks, over one channel per replica.

Requests and responses are not re-encoded: the request is parsed once to read its key, and
only a cluster image id (``<id>~<tag>``) is rewritten, to the replica's own id; `EncodeImage`'s
answer gets the tag. The replica answers exactly as a single server does (validation, limits,
API keys, streaming); its status, details and trailing metadata reach the client unchanged.
A replica that cannot be reached before the request was sent (its process is gone) is marked
down and the request goes to another; so does a request a replica refused for now (its queue
or its adapter slots full: RESOURCE_EXHAUSTED naming no field of the request, or the adapter)
before answering anything, while another replica is left to try. A replica lost mid-call ends
the call with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.cluster.affinity import affinity_key, tag_image_id, untag_image_id
from vlm_server.cluster.replica_set import NoReplica, Replica, ReplicaSet, Routed
from vlm_server.rpc.status import FIELD_METADATA_KEY

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["VisionLanguage"]
_NO_REPLICA = "no replica is serving; retry shortly"
_LOST = "the replica serving this call stopped; retry (another replica takes it)"
# What grpc core says when a channel never reached its peer: the request was not sent.
_NOT_CONNECTED = ("failed to connect", "connection refused", "connections to all backends")
# Fields of a RESOURCE_EXHAUSTED that another replica may not share: its own adapter slots.
_TRANSIENT_FIELDS = {"adapter", "settings.adapter"}
# Metadata that belongs to this hop; the rest (API keys, request ids) goes on.
_HOP_METADATA = ("user-agent", "grpc-", ":")
_PREPARE_ON_LOOP_BYTES = 1 << 20  # larger requests are parsed for their key in a thread


@dataclass(frozen=True)
class Method:
    name: str
    path: str
    request: Any  # the request message class
    streams: bool


METHODS = {
    f"/{SERVICE.full_name}/{m.name}": Method(
        m.name,
        f"/{SERVICE.full_name}/{m.name}",
        getattr(pb, m.input_type.name),
        m.server_streaming,
    )
    for m in SERVICE.methods
}


def _not_connected(err: grpc.aio.AioRpcError) -> bool:
    details = (err.details() or "").lower()
    return err.code() == grpc.StatusCode.UNAVAILABLE and any(s in details for s in _NOT_CONNECTED)


def _busy(err: grpc.aio.AioRpcError) -> bool:
    """A replica's refusal for now (a full queue or adapter slots), not of the request."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    field = next((v for k, v in err.trailing_metadata() or () if k == FIELD_METADATA_KEY), None)
    return field is None or field in _TRANSIENT_FIELDS


def _metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, Any]]:
    pairs = context.invocation_metadata() or ()
    return [(k, v) for k, v in pairs if not k.startswith(_HOP_METADATA)]


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.0)


def prepare(method: Method, data: bytes) -> tuple[bytes, str | None]:
    """(the bytes to send, the affinity key) of a request: its key read, a cluster image id
    replaced by the replica's own id. Malformed bytes go on as they are (the replica says
    what is wrong) with no key."""
    try:
        message = method.request.FromString(data)
    except Exception:
        return data, None
    try:
        key = affinity_key(message)
    except Exception:
        return data, None
    try:
        tagged = message.WhichOneof("image") == "image_id"
    except ValueError:  # no image oneof
        tagged = False
    if tagged and untag_image_id(message.image_id) != message.image_id:
        message.image_id = untag_image_id(message.image_id)
        data = message.SerializeToString()
    return data, key


async def _prepared(method: Method, data: bytes) -> tuple[bytes, str | None]:
    """`prepare`, off the event loop for a large picture."""
    if len(data) > _PREPARE_ON_LOOP_BYTES:
        return await asyncio.to_thread(prepare, method, data)
    return prepare(method, data)


class GrpcForwarder:
    """The generic handler of the API's methods, and the replicas' channels."""

    def __init__(self, replicas: ReplicaSet, max_message_bytes: int) -> None:
        self.replicas = replicas
        self._limit = max_message_bytes
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}

    def channel(self, replica: Replica) -> grpc.aio.Channel:
        """The replica's channel (a new one if its address changed)."""
        known = self._channels.get(replica.name)
        if known is not None and known[0] == replica.grpc:
            return known[1]
        channel = grpc.aio.insecure_channel(
            replica.grpc,
            options=[
                ("grpc.max_receive_message_length", self._limit),
                ("grpc.max_send_message_length", self._limit),
                # Fail a call at once when the replica is gone rather than wait for it.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._channels[replica.name] = (replica.grpc, channel)
        return channel

    async def forget(self, name: str) -> None:
        known = self._channels.pop(name, None)
        if known is not None:
            await known[1].close()

    async def close(self) -> None:
        for name in list(self._channels):
            await self.forget(name)

    def handler(self) -> grpc.GenericRpcHandler:
        forwarder = self

        class _Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                method = METHODS.get(details.method)
                if method is None:
                    return None
                if method.streams:
                    return grpc.unary_stream_rpc_method_handler(forwarder._stream_of(method))
                return grpc.unary_unary_rpc_method_handler(forwarder._unary_of(method))

        return _Handler()

    # --- calls --------------------------------------------------------------------------------

    def _unary_of(self, method: Method) -> Callable[..., Any]:
        async def unary(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
            data, key = await _prepared(method, data)
            tried: set[str] = set()
            while True:
                routed = await self._route(key, tried, context)
                call = self.channel(routed.replica).unary_unary(method.path)(
                    data, metadata=_metadata(context), timeout=_timeout(context)
                )
                try:
                    answer: bytes = await call
                    await _pass_trailing(call, context)  # the request id, as a server sends it
                except grpc.aio.AioRpcError as err:
                    if self._elsewhere(err, routed.replica, tried):
                        continue
                    await _abort(context, err)
                finally:
                    self.replicas.done(routed)
                if method.name == "EncodeImage":
                    answer = _tag(answer, data)
                return answer

        return unary

    def _stream_of(self, method: Method) -> Callable[..., AsyncIterator[bytes]]:
        async def stream(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            data, key = await _prepared(method, data)
            tried: set[str] = set()
            while True:
                routed = await self._route(key, tried, context)
                call = self.channel(routed.replica).unary_stream(method.path)(
                    data, metadata=_metadata(context), timeout=_timeout(context)
                )
                sent = 0
                try:
                    async for message in call:
                        sent += 1
                        yield message
                    await _pass_trailing(call, context)
                    return
                except grpc.aio.AioRpcError as err:
                    if not sent and self._elsewhere(err, routed.replica, tried):
                        continue
                    await _abort(context, err)
                finally:
                    call.cancel()  # a no-op once finished; a client that left cancels it
                    self.replicas.done(routed)

        return stream

    async def _route(
        self, key: str | None, tried: set[str], context: grpc.aio.ServicerContext
    ) -> Routed:
        try:
            return self.replicas.route(key, frozenset(tried))
        except NoReplica:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_REPLICA)
            raise  # abort raised already

    def _elsewhere(self, err: grpc.aio.AioRpcError, replica: Replica, tried: set[str]) -> bool:
        """Whether a request that got ``err`` from ``replica`` before any answer goes to
        another replica: ``replica`` was unreachable (marked down), or refused it for now
        while another replica is left."""
        tried.add(replica.name)
        if _not_connected(err):
            log.warning(
                "replica %s unreachable at %s; routing around it", replica.name, replica.grpc
            )
            self.replicas.unreachable(replica)
            return True
        return _busy(err) and any(r.name not in tried for r in self.replicas.serving())


async def _pass_trailing(call: Any, context: grpc.aio.ServicerContext) -> None:
    trailing = await call.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(tuple(trailing))


def _tag(answer: bytes, request: bytes) -> bytes:
    response = pb.EncodeImageResponse.FromString(answer)
    image = pb.EncodeImageRequest.FromString(request).image_bytes
    response.image_id = tag_image_id(response.image_id, image)
    return response.SerializeToString()


async def _abort(context: grpc.aio.ServicerContext, err: grpc.aio.AioRpcError) -> None:
    """End the call with the replica's status (UNAVAILABLE if the replica itself was lost)."""
    code, details = err.code(), err.details() or ""
    connection = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    if code in connection and not err.trailing_metadata() and _lost(details):
        code, details = grpc.StatusCode.UNAVAILABLE, _LOST
    trailing = err.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    await context.abort(code, details)


def _lost(details: str) -> bool:
    """grpc core's words for a connection that ended under a call (not a server's status)."""
    lowered = details.lower()
    return any(
        s in lowered for s in ("socket closed", "connection reset", "stream removed", "goaway")
    )
