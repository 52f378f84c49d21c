"""The gRPC server: listens at once, loads the engine behind NOT_SERVING, drains on request.

Lifecycle: `start` binds the ports (health answers right away: live, not ready) and begins
loading the engine in the background; `wait_ready` returns once it serves. `shutdown` turns
readiness off, refuses new calls with UNAVAILABLE, lets every accepted call finish within the
grace period, then stops the server and the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.engine.api import Engine, EngineStats
from vlm_server.service.config import ServerConfig
from vlm_server.service.health import HealthState
from vlm_server.service.images import ImageCache, ImageResolver, image_preparer
from vlm_server.service.metrics import ServiceMetrics
from vlm_server.service.servicer import SERVICE_NAME, Limits, VisionLanguageServicer

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]
_FINAL_STOP_GRACE_S = 1.0


class VisionLanguageServer:
    """One gRPC server in front of one engine (one process per GPU)."""

    def __init__(self, config: ServerConfig, engine_factory: EngineFactory) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.engine: Engine | None = None
        self.metrics = ServiceMetrics()
        self.health = HealthState(SERVICE_NAME)
        self._executor = ThreadPoolExecutor(
            config.decode_threads, thread_name_prefix="image-decode"
        )
        images = ImageResolver(
            config.image_limits,
            ImageCache(config.image_cache_bytes),
            self._executor,
            image_preparer(config),
        )
        limits = Limits(
            max_message_bytes=config.max_message_bytes,
            max_image_bytes=config.max_image_bytes,
            max_image_pixels=config.max_image_pixels,
            max_image_side=config.max_image_side,
            image_cache_bytes=config.image_cache_bytes,
        )
        self.servicer = VisionLanguageServicer(images, self.metrics, limits)
        self._server: grpc.aio.Server | None = None
        self._loading: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._shutting_down = False
        self.port = 0
        self.metrics_port = 0

    async def start(self) -> None:
        """Bind and serve health, reflection and metrics; load the engine in the background."""
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        pb_grpc.add_VisionLanguageServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server
        )
        address = f"{self.config.host}:{self.config.port}"
        self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        await self.health.loading()
        await server.start()
        self._server = server
        loop = asyncio.get_running_loop()
        self.metrics.watch_engine(loop, self._engine_stats)
        self.metrics_port = self.metrics.serve(
            self.config.metrics_host or self.config.host, self.config.metrics_port
        )
        log.info(
            "listening",
            extra={"fields": {"grpc_port": self.port, "metrics_port": self.metrics_port}},
        )
        self._loading = asyncio.create_task(self._load())

    def _engine_stats(self) -> EngineStats | None:
        engine = self.servicer.engine  # None until loaded: no gauges while loading
        return engine.stats() if engine is not None else None

    async def _load(self) -> None:
        started = time.perf_counter()
        log.info("loading model")
        # Off the loop: a factory may load the model itself, and health must keep answering.
        engine = await asyncio.to_thread(self._engine_factory)
        self.engine = engine
        await engine.start()
        info = engine.info
        self.servicer.engine = engine
        await self.health.ready()
        log.info(
            "ready",
            extra={
                "fields": {
                    "model": info.model_name,
                    "device": info.device,
                    "dtype": info.dtype,
                    "load_s": round(time.perf_counter() - started, 2),
                }
            },
        )

    async def wait_ready(self) -> None:
        """Return once the engine serves; raises what loading raised."""
        assert self._loading is not None, "start() first"
        await asyncio.shield(self._loading)

    @property
    def ready(self) -> bool:
        return self.servicer.engine is not None

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain (accepted calls finish within ``grace`` s), then stop everything."""
        if self._shutting_down:
            await self._stopped.wait()
            return
        self._shutting_down = True
        grace = self.config.grace_period if grace is None else grace
        deadline = time.monotonic() + grace
        log.info(
            "draining",
            extra={"fields": {"grace_s": grace, "in_flight": self.servicer.in_flight.count}},
        )
        self.servicer.begin_drain()
        await self.health.draining()
        await self.servicer.submitting.wait_empty(max(0.0, deadline - time.monotonic()))
        if self.engine is not None and self.servicer.engine is not None:
            await self.engine.drain(max(0.0, deadline - time.monotonic()))
        # Engine done: wait for the handlers to send their last messages.
        if not await self.servicer.in_flight.wait_empty(max(0.0, deadline - time.monotonic())):
            log.warning("grace period over; cancelling %d calls", self.servicer.in_flight.count)
        await self.health.stopped()
        if self._server is not None:
            await self._server.stop(_FINAL_STOP_GRACE_S)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self.engine is not None and self.servicer.engine is not None:
            await self.engine.close()
        await asyncio.to_thread(self.metrics.stop)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
