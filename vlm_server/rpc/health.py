"""grpc.health.v1 states: liveness on "" and readiness on the service's name.

Readiness is NOT_SERVING while the model loads and while the server drains, so a load
balancer stops sending work before the process stops taking it. Liveness stays SERVING until
the final stop.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from vlm_server.frontend.phase import ServerPhase

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthState(ServerPhase):
    """The server's phase (which the HTTP door's probes read too), mirrored into the health
    servicer at each transition."""

    def __init__(self, service_name: str) -> None:
        super().__init__()
        self.service_name = service_name
        self.servicer = health.aio.HealthServicer()

    async def loading(self) -> None:
        self.phase = "loading"
        await self.servicer.set("", SERVING)
        await self.servicer.set(self.service_name, NOT_SERVING)

    async def serving(self) -> None:
        self.phase = "serving"
        await self.servicer.set(self.service_name, SERVING)

    async def draining(self) -> None:
        self.phase = "draining"
        await self.servicer.set(self.service_name, NOT_SERVING)

    async def failed(self) -> None:
        """The engine cannot serve any more: not ready, and not live either, so that the
        process gets restarted."""
        self.phase = "failed"
        await self.servicer.set(self.service_name, NOT_SERVING)
        await self.servicer.set("", NOT_SERVING)

    async def stopped(self) -> None:
        """Everything NOT_SERVING, for good."""
        self.phase = "stopped"
        await self.servicer.enter_graceful_shutdown()
