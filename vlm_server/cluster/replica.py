"""One replica: the whole server (engine, request path, both doors), run by Ray Serve.

Its own doors listen on ``door_host`` (any free ports) and are listed in the directory, where
the cluster's gateway finds them and routes requests straight to them (``--ingress gateway``).
With Ray Serve's proxies instead (``--ingress ray``), the gRPC proxy calls the methods named as
the API's RPCs with the request message and the HTTP proxy calls ``__call__``; both pass the
request on to the same doors. Either way the replica's server answers exactly as a single
server does (validation, limits, errors, API keys, streaming).

Lifecycle: Ray marks the replica running once the model is loaded (the constructor waits for
it); `check_health` fails once the engine cannot serve, so Ray replaces the replica; on a
graceful stop Ray drains the replica's requests, then ``__del__`` drains and stops the server.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import Request
from starlette.responses import Response

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.chip_features import check_config
from vlm_server.cluster import proto_names  # noqa: F401  (pickle finds the messages)
from vlm_server.cluster.affinity import tag_image_id, untag_image_id
from vlm_server.cluster.http_forward import HttpForwarder
from vlm_server.devices import resolve_device
from vlm_server.options.table import ServerConfig
from vlm_server.server.engines import configure_process, engine_factory
from vlm_server.server.lifecycle import VisionLanguageServer
from vlm_server.server.memory import freeze

log = logging.getLogger(__name__)

# Metadata Ray's proxy adds for itself; everything else (API keys) goes on to the server.
_RAY_METADATA = {"application", "request_id", "multiplexed_model_id", "session_id"}
_LOST = "the replica serving this stream stopped; retry (another replica takes it)"


def door_addresses(door_host: str) -> tuple[str, str]:
    """(the address the replica's doors listen on, the address others reach them at)."""
    if door_host == "auto":
        import ray

        door_host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    if door_host in ("0.0.0.0", "::", ""):
        import ray

        return door_host or "0.0.0.0", ray.util.get_node_ip_address()
    return door_host, door_host


def _local(address: str) -> str:
    return "127.0.0.1" if address in ("0.0.0.0", "::", "") else address


def replica_config(values: dict[str, Any], host: str = "127.0.0.1") -> ServerConfig:
    """The replica's server config: the cluster's options, its doors on ``host``, any port."""
    values = {
        **values,
        "host": host,
        "port": 0,
        "http_port": -1,
        "metrics_port": 0,
    }
    return ServerConfig(**values)


def _metadata(grpc_context: Any) -> list[tuple[str, str]]:
    if grpc_context is None:
        return []
    pairs = grpc_context.invocation_metadata() or []
    return [(k, v) for k, v in pairs if k not in _RAY_METADATA and not k.startswith(":")]


def _untag(request: Any) -> Any:
    """Requests that send a cluster image id reach the server with the server's own id."""
    try:
        if request.WhichOneof("image") == "image_id":
            request.image_id = untag_image_id(request.image_id)
    except ValueError:  # no image oneof
        pass
    return request


def _refuse(err: grpc.aio.AioRpcError, grpc_context: Any) -> Exception:
    """The server's status, carried through Ray's proxy to the client."""
    if grpc_context is not None:
        grpc_context.set_code(err.code())
        grpc_context.set_details(err.details() or "")
        trailing = err.trailing_metadata()
        if trailing:
            grpc_context.set_trailing_metadata(list(trailing))
    return RuntimeError(f"{err.code().name}: {err.details()}")


def _mark_stream(grpc_context: Any, final: bool) -> None:
    """The status a stream ends with should this replica die before its next message.

    Ray's proxy applies the status each message carries, and reports a replica lost mid-call
    as INTERNAL only when none was set: until the final message, UNAVAILABLE (what a single
    server says when its engine dies: retry elsewhere), then OK."""
    if final:
        grpc_context.set_code(grpc.StatusCode.OK)
        grpc_context.set_details("")
    elif not grpc_context.code():
        grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
        grpc_context.set_details(_LOST)


class VisionLanguageReplica:
    """A Ray Serve deployment class: one replica per GPU (``num_gpus: 1``)."""

    async def __init__(
        self, config_values: dict[str, Any], app_name: str = "vlm", door_host: str = "127.0.0.1"
    ) -> None:
        listen, advertised = door_addresses(door_host)
        config = replica_config(config_values, listen)
        resolve_device(config.device)
        check_config(config)
        configure_process(config)
        self.config = config
        self.server = VisionLanguageServer(config, engine_factory(config))
        await self.server.start()
        await self.server.wait_ready()
        # As vlm serve does once the model is loaded (server/main.py).
        freeze()  # later collections skip the model's objects
        assert self.server.engine is not None  # ready: loaded
        self.server.engine.warm_constraints()
        limit = config.max_message_bytes
        local = _local(listen)
        self._channel = grpc.aio.insecure_channel(
            f"{local}:{self.server.port}",
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
        )
        self._stub = pb_grpc.VisionLanguageStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._http = HttpForwarder(local, self.server.http_port, config.max_http_body_bytes)
        self.name = _replica_name()
        self._app_name = app_name
        self._heartbeat = await _register(
            app_name, self.name, self.server, config.metrics_host, advertised
        )

    # --- gRPC, through Ray Serve's gRPC proxy -------------------------------------------------

    async def _unary(self, method: str, request: Any, grpc_context: Any) -> Any:
        call = getattr(self._stub, method)
        try:
            return await call(_untag(request), metadata=_metadata(grpc_context))
        except grpc.aio.AioRpcError as err:
            raise _refuse(err, grpc_context) from None

    async def _stream(self, method: str, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        call = getattr(self._stub, method)(_untag(request), metadata=_metadata(grpc_context))
        try:
            async for message in call:
                if grpc_context is not None:
                    _mark_stream(grpc_context, final=message.WhichOneof("event") == "result")
                yield message
        except grpc.aio.AioRpcError as err:
            raise _refuse(err, grpc_context) from None
        finally:
            call.cancel()  # a no-op once finished; a client that left cancels the request

    async def Caption(self, request: pb.CaptionRequest, grpc_context: Any = None):
        async for message in self._stream("Caption", request, grpc_context):
            yield message

    async def Query(self, request: pb.QueryRequest, grpc_context: Any = None):
        async for message in self._stream("Query", request, grpc_context):
            yield message

    async def Point(self, request: pb.PointRequest, grpc_context: Any = None) -> Any:
        return await self._unary("Point", request, grpc_context)

    async def Detect(self, request: pb.DetectRequest, grpc_context: Any = None) -> Any:
        return await self._unary("Detect", request, grpc_context)

    async def Segment(self, request: pb.SegmentRequest, grpc_context: Any = None) -> Any:
        return await self._unary("Segment", request, grpc_context)

    async def EncodeImage(self, request: pb.EncodeImageRequest, grpc_context: Any = None):
        response = await self._unary("EncodeImage", request, grpc_context)
        response.image_id = tag_image_id(response.image_id, request.image_bytes)
        return response

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context: Any = None):
        return await self._unary("GetModelInfo", request, grpc_context)

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None):
        """gRPC health: this replica's server's answer (``""`` liveness, the service name
        readiness), so a replica that drains says NOT_SERVING."""
        try:
            return await self._health.Check(request, timeout=5)
        except grpc.aio.AioRpcError as err:
            raise _refuse(err, grpc_context) from None

    # --- HTTP, through Ray Serve's HTTP proxy -------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        return await self._http.forward(request)

    # --- lifecycle ----------------------------------------------------------------------------

    def replica_name(self) -> str:
        return self.name

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The requests this replica's server holds (cluster/autoscaling.py's policy)."""
        from vlm_server.cluster.autoscaling import METRIC

        return {METRIC: float(self.server.core.in_flight.count)}

    async def check_health(self) -> None:
        engine = self.server.engine
        reason = engine.failure() if engine is not None else "no engine"
        if reason is not None:
            raise RuntimeError(f"the engine cannot serve: {reason}")

    async def __del__(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self.server.shutdown()
        await self._http.close()
        await self._channel.close()


def _replica_name() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray (tests of the class itself)
        return socket.gethostname()


async def _register(
    app_name: str, name: str, server: VisionLanguageServer, metrics_host: str, advertised: str
) -> asyncio.Task[None] | None:
    """Tell the application's directory where this replica's doors and metrics are, then keep
    telling it (the heartbeat that keeps the entry from expiring)."""
    import ray

    from vlm_server.cluster.directory import HEARTBEAT_S, directory

    if not ray.is_initialized():
        return None
    host = ray.util.get_node_ip_address() if metrics_host != "127.0.0.1" else "127.0.0.1"
    info = {
        "metrics": f"{host}:{server.metrics_port}",
        "grpc": f"{advertised}:{server.port}",
        "http": f"{advertised}:{server.http_port}",
        "node": ray.get_runtime_context().get_node_id(),
    }
    entry = directory(app_name)

    async def register() -> None:
        await asyncio.wrap_future(entry.register.remote(name, info).future())

    async def beat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await register()
            except Exception:  # the directory is being restarted: the next beat tells it
                log.warning("replica directory unreachable", exc_info=True)

    await register()
    return asyncio.create_task(beat(), name="directory-heartbeat")
