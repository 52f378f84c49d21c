"""The server: gRPC and HTTP front doors over one engine; listens at once, loads the engine
behind NOT_SERVING, drains on request.

Lifecycle: `start` binds the ports (health answers right away: live, not ready) and begins
loading the engine in the background; `wait_ready` returns once it serves. `shutdown` turns
readiness off, refuses new calls with UNAVAILABLE (HTTP: 503) through either door, lets every
accepted call finish within the grace period, then stops the doors and the engine.

The Batch API (``--data-dir``): its routes join the HTTP door; its jobs start once the
engine serves, start no more lines once a drain begins, and stop (lines still running after
the grace period cut off, to run again at the next start) before the engine does.

Exposure: plaintext or TLS (mutual with ``--tls-client-ca``), API keys checked on both doors
(gRPC: `AuthInterceptor`, health stays open), metrics on loopback unless told otherwise, and
SO_REUSEPORT off so that a second server on a taken port fails instead of sharing it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2_grpc

from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.bulk import http_api
from vlm_server.bulk.service import BatchApi
from vlm_server.engine.api import Engine, EngineStats
from vlm_server.frontend.api_keys import ApiKeys, read_keys_file
from vlm_server.frontend.metrics import ServiceMetrics
from vlm_server.http.server import Authorizer, HttpFrontDoor
from vlm_server.options.table import ServerConfig
from vlm_server.rpc.auth import AuthInterceptor, client_identity
from vlm_server.rpc.health import HealthState
from vlm_server.rpc.intake import IntakeInterceptor
from vlm_server.rpc.reflection import enable_reflection
from vlm_server.rpc.servicer import SERVICE_NAME, VisionLanguageServicer, server_version
from vlm_server.rpc.tls import server_credentials
from vlm_server.server.memory import Trimmer
from vlm_server.server.ports import port_in_use
from vlm_server.server.service import decode_executor, service_core

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]
_FINAL_STOP_GRACE_S = 1.0
FAILURE_POLL_S = 0.5  # how often health checks whether the engine can still serve


class ListenError(OSError):
    """A port could not be bound; the message names the address."""


def api_keys(config: ServerConfig) -> ApiKeys | None:
    """The keys of ``--api-keys`` and ``--api-keys-file`` together; None: no auth."""
    keys = list(config.api_keys)
    if config.api_keys_file:
        keys.extend(read_keys_file(config.api_keys_file))
        if not keys:
            raise ValueError(f"api_keys_file {config.api_keys_file}: no keys in it")
    return ApiKeys(keys) if keys else None


def tls_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """Server credentials of ``--tls-cert``/``--tls-key`` (and ``--tls-client-ca``)."""
    return server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)


class VisionLanguageServer:
    """The gRPC and HTTP doors in front of one engine (one process per GPU).

    ``http_auth`` checks the API keys of HTTP requests; by default the server's own keys
    (``--api-keys``), the same as gRPC's (None there: open)."""

    def __init__(
        self,
        config: ServerConfig,
        engine_factory: EngineFactory,
        http_auth: Authorizer | None = None,
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.engine: Engine | None = None
        self.metrics = ServiceMetrics()
        self.health = HealthState(SERVICE_NAME)
        self._executor = decode_executor(config)
        self.api_keys = api_keys(config)
        identify = functools.partial(client_identity, self.api_keys)
        self.core = service_core(config, self._executor, self.metrics, identify)
        self.servicer = VisionLanguageServicer(self.core)
        self.batches: BatchApi | None = None
        if config.data_dir is not None:
            concurrency = config.batch_concurrency or config.max_batch_size
            self.batches = BatchApi(
                config.data_dir,
                config.max_batch_file_bytes,
                config.max_batch_lines,
                concurrency,
            )
        self.http: HttpFrontDoor | None = None
        if config.http_port != 0:
            auth = http_auth if http_auth is not None else self.api_keys
            self.http = HttpFrontDoor(
                self.core,
                config.max_http_body_bytes,
                auth,
                server_version(),
                self.health,
                http_api.routes(self.batches),
            )
        self._trimmer = Trimmer(config.memory_trim_interval)
        self._server: grpc.aio.Server | None = None
        self._loading: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._shutting_down = False
        self.port = 0
        self.http_port = 0
        self.metrics_port = 0

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        reject = self.servicer.record_rejected
        cfg = self.config
        limits = {
            "question": cfg.max_question_chars,
            "object": cfg.max_object_chars,
            "regex": cfg.max_regex_chars,
            "choices": cfg.max_choice_chars,
        }
        intake = IntakeInterceptor(
            reject,
            self.servicer.record_unstarted,
            (SERVICE_NAME,),
            field_limits=limits,
            executor=self._executor,  # large messages are parsed beside the image decodes
        )
        chain: list[grpc.aio.ServerInterceptor] = [intake]
        if self.api_keys is not None:  # its refusals parse nothing
            chain.append(AuthInterceptor(self.api_keys, reject))
        return chain

    def _bind(self, server: grpc.aio.Server) -> int:
        address = f"{self.config.host}:{self.config.port}"
        credentials = tls_credentials(self.config)
        if port_in_use(self.config.host, self.config.port):
            raise ListenError(
                f"cannot listen on {address}: port {self.config.port} is in use "
                "(another server?); choose another with --port"
            )
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError:
            port = 0
        if port == 0:
            tls = "; or the TLS certificate and key do not match" if credentials else ""
            raise ListenError(
                f"cannot listen on {address}: port {self.config.port} is in use "
                f"(another server?) or the address is not one of this machine's{tls}"
            )
        return port

    def _serve_metrics(self) -> int:
        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            return self.metrics.serve(host, port)
        except OSError as err:
            reason = err.strerror or str(err)
            raise ListenError(
                f"cannot serve metrics on {host}:{port}: {reason} (--metrics-port)"
            ) from None

    async def _serve_http(self) -> int:
        assert self.http is not None
        host, port = self.config.host, self.config.http_port
        try:
            return await self.http.start(host, port)
        except OSError as err:
            reason = err.strerror or str(err)
            raise ListenError(
                f"cannot serve HTTP on {host}:{port}: {reason} (--http-port)"
            ) from None

    async def start(self) -> None:
        """Bind and serve health, reflection and metrics; load the engine in the background.

        Raises `ListenError` naming the port when a port is taken: gRPC's SO_REUSEPORT is
        off, so a second server on the same port fails instead of sharing connections."""
        if self.batches is not None:
            await self.batches.open()  # a data dir it cannot use stops the start here
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            interceptors=self._interceptors(),
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_VisionLanguageServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        enable_reflection((SERVICE_NAME, "grpc.health.v1.Health"), server)
        self.port = self._bind(server)
        try:
            self.metrics_port = self._serve_metrics()
            if self.http is not None:
                self.http_port = await self._serve_http()
        except ListenError:
            await server.stop(None)
            await asyncio.to_thread(self.metrics.stop)
            if self.batches is not None:
                await self.batches.close()
            raise
        await self.health.loading()
        await server.start()
        self._server = server
        loop = asyncio.get_running_loop()
        self.metrics.watch_engine(loop, self._engine_stats)
        self.metrics.watch_loop()
        self._trimmer.start()
        if self.http is not None and self.config.tls_cert is not None:
            log.warning(
                "the HTTP door on port %d is plaintext: put it behind a TLS proxy, or turn "
                "it off with --http-port 0",
                self.http_port,
            )
        if self.api_keys is None and self.config.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning(
                "no API keys: anyone who can reach %s:%d may call (see --api-keys-file)",
                self.config.host,
                self.port,
            )
        log.info(
            "listening",
            extra={
                "fields": {
                    "grpc_port": self.port,
                    "metrics_port": self.metrics_port,
                    "http_port": self.http_port,
                    "tls": self.config.tls_cert is not None,
                    "api_keys": len(self.api_keys) if self.api_keys is not None else 0,
                }
            },
        )
        self._loading = asyncio.create_task(self._load())

    def _engine_stats(self) -> EngineStats | None:
        engine = self.core.engine  # None until loaded: no gauges while loading
        return engine.stats() if engine is not None else None

    async def _load(self) -> None:
        started = time.perf_counter()
        log.info("loading model")
        # Off the loop: a factory may load the model itself, and health must keep answering.
        engine = await asyncio.to_thread(self._engine_factory)
        self.engine = engine
        engine.watch_events_delay(self.metrics.events_delay.observe)
        await engine.start()
        info = engine.info
        self.core.engine = engine
        await self.health.serving()
        self._watching = asyncio.create_task(self._watch_failure(engine))
        if self.batches is not None and not self._shutting_down:
            self.batches.start(self.core)
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

    async def _watch_failure(self, engine: Engine) -> None:
        """Health goes NOT_SERVING, liveness too, once the engine cannot serve any more (its
        requests already fail with UNAVAILABLE): the orchestrator should restart us."""
        while (reason := engine.failure()) is None:
            await asyncio.sleep(FAILURE_POLL_S)
        log.error("the engine cannot serve: %s", reason)
        if not self._shutting_down:
            await self.health.failed()

    async def wait_ready(self) -> None:
        """Return once the engine serves; raises what loading raised."""
        assert self._loading is not None, "start() first"
        await asyncio.shield(self._loading)

    @property
    def ready(self) -> bool:
        return self.core.engine is not None

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
            extra={"fields": {"grace_s": grace, "in_flight": self.core.in_flight.count}},
        )
        if self.batches is not None:
            self.batches.stop_starting()
        self.core.begin_drain()
        await self.health.draining()
        await self.core.submitting.wait_empty(max(0.0, deadline - time.monotonic()))
        if self.engine is not None and self.core.engine is not None:
            await self.engine.drain(max(0.0, deadline - time.monotonic()))
        # Engine done: wait for the handlers to send their last messages.
        if not await self.core.in_flight.wait_empty(max(0.0, deadline - time.monotonic())):
            log.warning("grace period over; cancelling %d calls", self.core.in_flight.count)
        if self.batches is not None:  # before the engine stops: its lines must not fail
            await self.batches.stop_jobs(max(0.0, deadline - time.monotonic()))
        await self.health.stopped()
        if self.http is not None:
            await self.http.stop()
        if self.batches is not None:
            await self.batches.close()
        if self._server is not None:
            await self._server.stop(_FINAL_STOP_GRACE_S)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._watching is not None:
            self._watching.cancel()
        if self.engine is not None and self.core.engine is not None:
            await self.engine.close()
        await self.metrics.unwatch_loop()
        await asyncio.to_thread(self.metrics.stop)
        await self._trimmer.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
