"""The cluster's gateway: the gRPC and HTTP doors clients call, routing each request by image
affinity straight to a replica's own doors.

Ray Serve runs the replicas (placement on GPUs, health checks, restarts, autoscaling); the
gateway only routes. Each replica reports its doors to the directory; the gateway reads the
directory every `REFRESH_S` and asks each member's gRPC health (readiness) as often: a replica
is routed to while it answers SERVING, so one that drains or dies stops getting requests
within a refresh, and one that cannot be reached is skipped at once (`ReplicaSet.unreachable`).

Why not Ray Serve's own proxies (``--ingress ray``, still available): they carry each request
through Ray's actor calls, which cost a single client about a quarter more latency and cap
throughput at a few hundred requests a second on cheap repeated-image requests
(docs/deployment.md has the figures).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from vlm_server.cluster.gateway_grpc import SERVICE, GrpcForwarder
from vlm_server.cluster.gateway_http import HttpGateway
from vlm_server.cluster.replica_set import DEFAULT_MISS_COST, ReplicaSet
from vlm_server.cluster.shared_loads import WorkerLoads
from vlm_server.rpc.reflection import enable_reflection

log = logging.getLogger(__name__)

REFRESH_S = 1.0
PROBE_TIMEOUT_S = 2.0
Entries = Callable[[], Awaitable[Mapping[str, Mapping[str, Any]]]]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Gateway:
    """Both doors over one `ReplicaSet`, kept current from ``entries`` (the directory)."""

    def __init__(
        self,
        entries: Entries,
        load_factor: float,
        max_message_bytes: int,
        max_http_body_bytes: int,
        refresh_s: float = REFRESH_S,
        miss_cost: float = DEFAULT_MISS_COST,
        publish: bool = False,
        shared: WorkerLoads | None = None,
    ) -> None:
        """``publish`` and ``shared``: a worker among several (`ReplicaSet`)."""
        self.replicas = ReplicaSet(load_factor, miss_cost=miss_cost, publish=publish, shared=shared)
        self._entries = entries
        self._refresh_s = refresh_s
        self._limit = max_message_bytes
        self.grpc = GrpcForwarder(self.replicas, max_message_bytes)
        self.http = HttpGateway(self.replicas, max_http_body_bytes)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.port = 0
        self.http_port = 0

    async def start(
        self,
        host: str,
        port: int,
        http_port: int,
        reuse_port: bool = False,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        """Listen (``http_port`` 0: no HTTP door, -1: any port) and start following the
        replicas. ``reuse_port``: the ports are shared with the other gateway workers (the
        kernel spreads connections over them); otherwise a port in use is an error.
        ``credentials``: TLS on the gRPC door (the HTTP door is plaintext, as a server's)."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._limit),
                ("grpc.max_send_message_length", self._limit),
                ("grpc.so_reuseport", int(reuse_port)),
            ]
        )
        server.add_generic_rpc_handlers((self.grpc.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((SERVICE.full_name, health.SERVICE_NAME), server)
        address = f"{host}:{port}"
        if credentials is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, credentials)
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port} (--port)")
        await self.health.set("", SERVING)
        await self.health.set(SERVICE.full_name, NOT_SERVING)
        await server.start()
        self._server = server
        if http_port:
            self.http_port = await self.http.start(host, max(http_port, 0), reuse_port)
        self._watch = asyncio.create_task(self._follow(), name="gateway-replicas")

    async def wait_ready(self, replicas: int = 1) -> None:
        """Until at least ``replicas`` replicas serve."""
        while len(self.replicas.serving()) < replicas:
            await asyncio.sleep(self._refresh_s / 4)

    async def stop(self, grace: float) -> None:
        """Drain: not ready at once, no new calls, accepted ones get ``grace`` seconds."""
        await self.health.set(SERVICE.full_name, NOT_SERVING)
        if self._watch is not None:
            self._watch.cancel()
        stops = [self.http.stop(grace)]
        if self._server is not None:
            stops.append(self._server.stop(grace))
        for failed in await asyncio.gather(*stops, return_exceptions=True):
            if isinstance(failed, BaseException):
                log.error("a door did not stop cleanly", exc_info=failed)
        await self.grpc.close()
        await self.health.enter_graceful_shutdown()

    # --- following the replicas -----------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the directory is briefly away (a restart): keep what we know
                log.exception("reading the replica directory failed")
            await asyncio.sleep(self._refresh_s)

    async def refresh(self) -> None:
        """One round: the directory's members, then each one's readiness."""
        entries = await self._entries()
        added, removed = self.replicas.update(entries)
        for name in removed:
            await self.grpc.forget(name)
        for name in added:
            log.info("replica %s joined at %s", name, self.replicas.get(name).grpc)  # type: ignore[union-attr]
        members = self.replicas.members()
        answers = await asyncio.gather(*(self._probe(r.name) for r in members))
        for replica, serving in zip(members, answers, strict=True):
            if replica.serving != serving:
                log.info("replica %s %s", replica.name, "serving" if serving else "not serving")
            self.replicas.set_serving(replica.name, serving)
        ready = SERVING if self.replicas.serving() else NOT_SERVING
        await self.health.set(SERVICE.full_name, ready)

    async def _probe(self, name: str) -> bool:
        replica = self.replicas.get(name)
        if replica is None:
            return False
        stub = health_pb2_grpc.HealthStub(self.grpc.channel(replica))
        try:
            answer = await stub.Check(
                health_pb2.HealthCheckRequest(service=SERVICE.full_name),
                timeout=PROBE_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError:
            return False
        return answer.status == SERVING

    # --- metrics --------------------------------------------------------------------------------

    def counts(self) -> dict[str, Any]:
        """The routing counts `routing_metrics` reports (summed over workers)."""
        return {
            "routed": {r.name: r.routed for r in self.replicas.members()},
            "home_hits": self.replicas.home_hits,
            "serving": len(self.replicas.serving()),
        }

    def metrics_text(self) -> str:
        return routing_metrics([self.counts()])


def routing_metrics(counts: list[dict[str, Any]]) -> str:
    """Prometheus lines of the gateway's routing, summed over its workers' `Gateway.counts`
    (joined to the replicas' aggregated metrics)."""
    routed: dict[str, int] = {}
    for c in counts:
        for name, n in c["routed"].items():
            routed[name] = routed.get(name, 0) + n
    lines = [
        "# HELP vlm_gateway_routed_total Requests the gateway routed, by replica.",
        "# TYPE vlm_gateway_routed_total counter",
        *(f'vlm_gateway_routed_total{{replica="{n}"}} {v}' for n, v in sorted(routed.items())),
        "# HELP vlm_gateway_home_hits_total Requests with an image that went to its replica.",
        "# TYPE vlm_gateway_home_hits_total counter",
        f"vlm_gateway_home_hits_total {sum(c['home_hits'] for c in counts)}",
        "# HELP vlm_gateway_replicas_serving Replicas the gateway routes to.",
        "# TYPE vlm_gateway_replicas_serving gauge",
        f"vlm_gateway_replicas_serving {max((c['serving'] for c in counts), default=0)}",
    ]
    return "\n".join(lines) + "\n"
