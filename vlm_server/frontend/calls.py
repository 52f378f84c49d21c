"""What every front door (gRPC, HTTP) shares: the engine, the drain state, and the bookkeeping
of one request.

`ServiceCore` holds the state the doors share; `Call` admits one request (refused while the
model loads or the server drains), builds its engine request through the one shared validation
(`request_builder.build`), runs it, and on exit records metrics and the access-log line. Turning an
error into a status is the door's job: `Call` lets every exception through.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from vlm_server.engine.api import (
    Delta,
    Engine,
    EngineError,
    EngineInfo,
    ErrorCode,
    Finished,
    GenerationRequest,
    RequestMetrics,
    RequestStream,
    Task,
)
from vlm_server.frontend import request_builder, validation
from vlm_server.frontend.images import ImageResolver
from vlm_server.frontend.logs import log_request
from vlm_server.frontend.metrics import ServiceMetrics
from vlm_server.frontend.refusals import unavailable

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class Door(enum.StrEnum):
    """The way a request came in (the ``door`` label of the metrics)."""

    GRPC = "grpc"
    HTTP = "http"
    BATCH = "batch"  # a line of a batch job (vlm batch, the Batch API)


def deadline_passed(deadline: float | None, timeout: float | None) -> bool:
    """Whether a call the transport cancelled is best reported as past its deadline
    (``time.monotonic()`` values; ``timeout`` the call's whole allowance as received).

    A handler is cancelled alike when the client hangs up and when the deadline passes, and
    the client's own deadline timer fires first: its cancel can reach the server before the
    server's copy of the deadline, by as much as the request's trip took beyond the cancel's
    (tens of milliseconds on a loaded machine). So a cancel inside the last part of the
    allowance counts as the deadline's: its last 10 ms at least, its whole length for calls
    of up to 100 ms, the last 100 ms of longer ones."""
    if deadline is None:
        return False
    slack = 0.01 if timeout is None else max(0.01, min(timeout, 0.1))
    return time.monotonic() >= deadline - slack


def request_id(client_value: str | None) -> str:
    """The client's request id when it is well formed, else a fresh one."""
    if client_value and _REQUEST_ID.match(client_value):
        return client_value
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Limits:
    """Server-side limits reported by GetModelInfo."""

    max_message_bytes: int
    max_image_bytes: int
    max_image_pixels: int
    max_image_side: int
    image_cache_bytes: int
    max_object_chars: int = validation.MAX_OBJECT_CHARS
    max_question_chars: int = validation.MAX_QUESTION_CHARS

    def describe(self, info: EngineInfo) -> dict[str, int]:
        """Every limit a client can hit, the server's and the engine's, by the names of the
        API's ``ServerLimits``."""
        return {
            "max_message_bytes": self.max_message_bytes,
            "max_image_bytes": self.max_image_bytes,
            "max_image_pixels": self.max_image_pixels,
            "max_image_side": self.max_image_side,
            "max_tokens": info.max_context,
            "max_queue": info.max_queue,
            "image_cache_bytes": self.image_cache_bytes,
            "max_object_chars": self.max_object_chars,
            "max_question_chars": self.max_question_chars,
            "max_choices": info.max_choices,
            "max_choice_chars": info.max_choice_chars,
            "max_regex_chars": info.max_regex_chars,
            "max_spatial_refs": info.max_spatial_refs,
            "max_adapters": info.max_adapters,
            "max_adapter_rank": info.max_adapter_rank,
        }


Identify = Callable[[Any, str], str]  # (request metadata, peer) -> client identity


class Gate:
    """Counts requests in some phase; lets shutdown wait until none is left."""

    def __init__(self) -> None:
        self.count = 0
        self._zero = asyncio.Event()
        self._zero.set()

    def enter(self) -> None:
        self.count += 1
        self._zero.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._zero.set()

    async def wait_empty(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._zero.wait(), timeout)
        except TimeoutError:
            return False
        return True


class ServiceCore:
    """The engine (None while loading), the drain flag and the gates every door shares."""

    def __init__(
        self,
        images: ImageResolver,
        metrics: ServiceMetrics,
        limits: Limits,
        identify: Identify | None = None,
    ) -> None:
        self.images = images
        self.metrics = metrics
        self.limits = limits
        self._identify = identify
        self.engine: Engine | None = None
        self.draining = False
        self.in_flight = Gate()  # requests being handled, from arrival to last byte
        self.submitting = Gate()  # accepted requests that have not reached the engine yet

    def begin_drain(self) -> None:
        """Refuse requests from now on; those already received still run."""
        self.draining = True

    def client_of(self, metadata: Any, peer: str) -> str:
        """Who sent a request: an API key's identity, else the peer's address."""
        return peer if self._identify is None else self._identify(metadata, peer)

    def record_early(self, door: Door, task: str, code: str, fields: dict[str, Any]) -> None:
        """Count and log a request that ended before its handler ran."""
        self.metrics.received.labels(door, task).inc()
        self.metrics.requests.labels(door, task, code).inc()
        log_request({"door": door.value, "task": task, "code": code, **fields})


class Call:
    """One request through any door: admission, timing, running it, metrics, access log.

    Use as ``async with``. ``deadline`` is a ``time.monotonic()`` value (None: none)."""

    def __init__(
        self,
        core: ServiceCore,
        door: Door,
        task: str,
        request_id: str,
        peer: str = "",
        deadline: float | None = None,
    ) -> None:
        self.core = core
        self.door = door
        self.task = task
        self.request_id = request_id
        self.peer = peer
        self.deadline = deadline
        # The allowance as received: how a cancel near the deadline is told (deadline_passed).
        self.timeout = None if deadline is None else deadline - time.monotonic()
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.engine_metrics: RequestMetrics | None = None
        self.finish_reason = ""
        # Spent here before the engine: the request's checks and its image (digest, decode).
        self.intake_ms = 0.0
        # Received before a drain began = accepted: it may still submit to the engine.
        self.accepted = not core.draining
        self._submitting = False
        # The whole answer was handed to the transport: a client that hangs up after reading
        # it (the gRPC clients cancel their finished stream) ended nothing.
        self.answered = False

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3

    def expired(self) -> bool:
        return deadline_passed(self.deadline, self.timeout)

    async def __aenter__(self) -> Call:
        c = self.core
        c.in_flight.enter()
        c.metrics.in_flight.labels(self.door).inc()
        c.metrics.received.labels(self.door, self.task).inc()
        if self.accepted:
            c.submitting.enter()
            self._submitting = True
        return self

    def engine(self) -> Engine:
        """The engine, or UNAVAILABLE while it loads or the server drains."""
        if not self.accepted:
            raise unavailable("the server is draining; retry elsewhere")
        if self.core.engine is None:
            raise unavailable("the model is loading; retry shortly")
        return self.core.engine

    def submitted(self) -> None:
        """Called once the request reached the engine (or will not): the drain stops waiting."""
        if self._submitting:
            self._submitting = False
            self.core.submitting.leave()

    async def build(self, message: Any) -> GenerationRequest:
        """Check a proto request message of this call's task and build the engine request."""
        max_context = self.engine().info.max_context
        t0 = time.perf_counter()
        built = await request_builder.build(
            Task(self.task),
            message,
            self.core.images,
            request_id=self.request_id,
            deadline=self.deadline,
            max_tokens_limit=max_context,
            max_object_chars=self.core.limits.max_object_chars,
            max_question_chars=self.core.limits.max_question_chars,
            max_spatial_refs=self.engine().info.max_spatial_refs,
        )
        self.intake_ms = (time.perf_counter() - t0) * 1e3
        self.core.metrics.intake.labels(self.door, self.task).observe(self.intake_ms / 1e3)
        return built

    async def submit(self, request: GenerationRequest) -> RequestStream:
        stream = await self.engine().submit(request)
        self.submitted()
        return stream

    async def final(self, request: GenerationRequest) -> Finished:
        """Run a request to its one result."""
        return await self.result(await self.submit(request))

    async def result(self, stream: RequestStream) -> Finished:
        """The `Finished` event of a submitted request."""
        try:
            async for event in stream:
                if isinstance(event, Finished):
                    self.engine_metrics, self.finish_reason = event.metrics, event.finish_reason
                    return event
        finally:
            stream.cancel()  # frees the request if this handler is cancelled; else a no-op
        raise EngineError(ErrorCode.INTERNAL, "the engine ended the request without a result")

    async def events(self, stream: RequestStream) -> AsyncIterator[Delta | Finished]:
        """The events of a submitted request: its deltas (text, or a segment's outline), then
        its `Finished` (the last).

        Submit first, then start answering: errors at admission (queue full, beyond the
        context) then still reach the client as a status, not as an event of a begun stream."""
        try:
            async for event in stream:
                if self.first_token is None:
                    self.first_token = time.perf_counter()
                if isinstance(event, Finished):
                    self.engine_metrics, self.finish_reason = event.metrics, event.finish_reason
                    yield event
                    return
                yield event
        finally:
            stream.cancel()
        raise EngineError(ErrorCode.INTERNAL, "the engine ended the request without a result")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.submitted()
        code = status_code(exc)
        if code == "CANCELLED" and self.answered:
            code = "OK"
        elif code == "CANCELLED" and self.expired():
            # A transport cancels the handler both when the client goes away and when the
            # deadline passes; only the clock tells them apart.
            code = "DEADLINE_EXCEEDED"
        self._record(code, exc, tb)
        self.core.in_flight.leave()
        self.core.metrics.in_flight.labels(self.door).dec()
        return False

    def _record(self, code: str, exc: BaseException | None, tb: TracebackType | None) -> None:
        if code == "INTERNAL" and exc is not None:
            log.error(
                "request %s (%s) failed",
                self.request_id,
                self.task,
                exc_info=(type(exc), exc, tb),
            )
        total_s = time.perf_counter() - self.start
        m = self.core.metrics
        m.requests.labels(self.door, self.task, code).inc()
        m.latency.labels(self.door, self.task).observe(total_s)
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "door": self.door.value,
            "task": self.task,
            "code": code,
            "total_ms": total_s * 1e3,
        }
        if self.first_token is not None:
            m.ttft.labels(self.door, self.task).observe(self.first_token - self.start)
            fields["ttft_ms"] = (self.first_token - self.start) * 1e3
        em = self.engine_metrics
        if em is not None:
            m.queue_wait.labels(self.door, self.task).observe(em.queue_wait_ms / 1e3)
            m.output_tokens.labels(self.door, self.task).inc(em.output_tokens)
            fields.update(
                intake_ms=self.intake_ms,
                queue_ms=em.queue_wait_ms,
                prefix_wait_ms=em.prefix_wait_ms,
                prefill_ms=em.prefill_ms,
                decode_ms=em.decode_ms,
                input_tokens=em.input_tokens,
                output_tokens=em.output_tokens,
                cached_tokens=em.cached_tokens,
                reasoning_tokens=em.reasoning_tokens,
                finish=self.finish_reason,
            )
        if isinstance(exc, EngineError):
            fields["error"] = exc.message
        if self.peer:
            fields["peer"] = self.peer
        log_request(fields)


def status_code(exc: BaseException | None) -> str:
    """The status-code name a request that ended with ``exc`` is counted under."""
    if exc is None:
        return "OK"
    if isinstance(exc, EngineError):
        return exc.code.value
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "INTERNAL"
