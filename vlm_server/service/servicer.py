"""The ``vlm.v1.VisionLanguage`` servicer: proto in, engine requests out, events back.

Engine-agnostic: it only uses the `Engine` protocol. Each RPC goes through `_Call`, which
admits it (UNAVAILABLE while loading or draining), maps errors to status codes, records
metrics and writes the access-log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.engine.api import (
    Engine,
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    RequestMetrics,
    RequestStream,
    Task,
    TextDelta,
)
from vlm_server.service import convert, validation
from vlm_server.service.errors import (
    FIELD_METADATA_KEY,
    REQUEST_ID_METADATA_KEY,
    STATUS,
    proto_field,
    unavailable,
)
from vlm_server.service.images import ImageResolver
from vlm_server.service.logs import log_request
from vlm_server.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VisionLanguage"].full_name
# The task label of each RPC in metrics and the access log.
RPC_TASKS = {
    "Caption": Task.CAPTION.value,
    "Query": Task.QUERY.value,
    "Point": Task.POINT.value,
    "Detect": Task.DETECT.value,
    "Segment": Task.SEGMENT.value,
    "EncodeImage": "encode_image",
    "GetModelInfo": "model_info",
}
CLIENT_REQUEST_ID_KEY = "x-request-id"
Identify = Callable[[Any, str], str]  # (invocation metadata, peer) -> client identity
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def _server_version() -> str:
    try:
        return importlib.metadata.version("moondream-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Limits:
    """Server-side limits reported by GetModelInfo."""

    max_message_bytes: int
    max_image_bytes: int
    max_image_pixels: int
    max_image_side: int
    image_cache_bytes: int
    max_object_chars: int = validation.MAX_OBJECT_CHARS


class _Gate:
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


class _Call:
    """Bookkeeping of one RPC: admission, timing, error -> status, metrics, access log."""

    def __init__(
        self, servicer: VisionLanguageServicer, task: str, context: grpc.aio.ServicerContext
    ) -> None:
        self.servicer = servicer
        self.task = task
        self.context = context
        self.request_id = _request_id(context)
        # Read now: after a client cancel the call's core object may be gone, and touching
        # the context then can crash the process.
        self.peer = context.peer()
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.engine_metrics: RequestMetrics | None = None
        self.finish_reason = ""
        # Received before a drain began = accepted: it may still submit to the engine.
        self.accepted = not servicer.draining
        self._submitting = False

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3

    def deadline(self) -> float | None:
        """The call's deadline as a time.monotonic() value (None: the client set none)."""
        return self._deadline

    def expired(self) -> bool:
        # A little slack: gRPC's timer and this clock need not agree to the millisecond.
        return self._deadline is not None and time.monotonic() >= self._deadline - 0.01

    async def __aenter__(self) -> _Call:
        s = self.servicer
        s.in_flight.enter()
        s.metrics.in_flight.inc()
        s.metrics.received.labels(self.task).inc()
        self.context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, self.request_id),))
        if self.accepted:
            s.submitting.enter()
            self._submitting = True
        return self

    def engine(self) -> Engine:
        """The engine, or UNAVAILABLE while it loads or the server drains."""
        s = self.servicer
        if not self.accepted:
            raise unavailable("the server is draining; retry elsewhere")
        if s.engine is None:
            raise unavailable("the model is loading; retry shortly")
        return s.engine

    def submitted(self) -> None:
        if self._submitting:
            self._submitting = False
            self.servicer.submitting.leave()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.submitted()
        s = self.servicer
        if exc is None:
            code = "OK"
        elif isinstance(exc, EngineError):
            code = exc.code.value
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            # gRPC cancels the handler both when the client cancels and when the deadline
            # passes; only the clock tells them apart.
            code = "DEADLINE_EXCEEDED" if self.expired() else "CANCELLED"
        else:
            code = "INTERNAL"
            log.error(
                "request %s (%s) failed", self.request_id, self.task, exc_info=(exc_type, exc, tb)
            )  # type: ignore[arg-type]
        self._record(code, exc)
        s.in_flight.leave()
        s.metrics.in_flight.dec()
        if isinstance(exc, EngineError):
            trailing: tuple[tuple[str, str], ...] = ((REQUEST_ID_METADATA_KEY, self.request_id),)
            field = proto_field(exc.field)
            if field:
                trailing += ((FIELD_METADATA_KEY, field),)
            await self.context.abort(STATUS[exc.code], exc.message, trailing_metadata=trailing)
        if code == "INTERNAL":
            await self.context.abort(
                grpc.StatusCode.INTERNAL, f"internal error (request id {self.request_id})"
            )
        return False

    def _record(self, code: str, exc: BaseException | None) -> None:
        total_s = time.perf_counter() - self.start
        m = self.servicer.metrics
        m.requests.labels(self.task, code).inc()
        m.latency.labels(self.task).observe(total_s)
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "task": self.task,
            "code": code,
            "total_ms": total_s * 1e3,
        }
        if self.first_token is not None:
            m.ttft.labels(self.task).observe(self.first_token - self.start)
            fields["ttft_ms"] = (self.first_token - self.start) * 1e3
        em = self.engine_metrics
        if em is not None:
            m.queue_wait.labels(self.task).observe(em.queue_wait_ms / 1e3)
            m.output_tokens.labels(self.task).inc(em.output_tokens)
            fields.update(
                queue_ms=em.queue_wait_ms,
                prefill_ms=em.prefill_ms,
                decode_ms=em.decode_ms,
                input_tokens=em.input_tokens,
                output_tokens=em.output_tokens,
                cached_tokens=em.cached_tokens,
                finish=self.finish_reason,
            )
        if isinstance(exc, EngineError):
            fields["error"] = exc.message
        if self.peer:
            fields["peer"] = self.peer
        log_request(fields)


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_REQUEST_ID_KEY and isinstance(value, str) and _REQUEST_ID.match(value):
            return value
    return uuid.uuid4().hex[:16]


class VisionLanguageServicer(pb_grpc.VisionLanguageServicer):
    """Implements every RPC of ``vlm.v1.VisionLanguage`` against an `Engine`."""

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
        self.in_flight = _Gate()
        self.submitting = _Gate()

    def _record_early(self, method: str, code: str, fields: dict[str, Any]) -> None:
        """Count and log a call of ours that ended before its handler ran."""
        service, _, name = method.lstrip("/").partition("/")
        if service != SERVICE_NAME or name not in RPC_TASKS:
            return
        task = RPC_TASKS[name]
        self.metrics.received.labels(task).inc()
        self.metrics.requests.labels(task, code).inc()
        log_request({"task": task, "code": code, **fields})

    def record_rejected(self, method: str, code: grpc.StatusCode, message: str) -> None:
        """A call refused before its handler ran (bad protobuf, no API key)."""
        self._record_early(method, code.name, {"error": message})

    def record_unstarted(self, method: str) -> None:
        """A call that ended before its handler ran: gRPC ends a call whose deadline passes
        (or whose client cancels) while its request is still arriving. It cannot say which
        of the two, so the code is CANCELLED with ``stage=receiving`` in the log."""
        self._record_early(method, "CANCELLED", {"stage": "receiving"})

    def client_of(self, call: _Call) -> str:
        """Who sent ``call``: an API key's identity, else the peer's address."""
        if self._identify is None:
            return call.peer
        return self._identify(call.context.invocation_metadata(), call.peer)

    def begin_drain(self) -> None:
        """Refuse RPCs from now on; those already received still run."""
        self.draining = True

    def _call(self, task: str, context: grpc.aio.ServicerContext) -> _Call:
        return _Call(self, task, context)

    def _max_tokens(self, engine: Engine) -> int:
        return engine.info.max_context

    async def _submit(self, call: _Call, request: GenerationRequest) -> RequestStream:
        engine = call.engine()
        stream = await engine.submit(request)
        call.submitted()
        # Frees the engine's request when the RPC ends for any reason (client cancel,
        # deadline), without waiting for the handler's generator to be finalized.
        call.context.add_done_callback(lambda _: stream.cancel())
        return stream

    async def _final(self, call: _Call, request: GenerationRequest) -> Finished:
        """Run a request that answers with one message."""
        stream = await self._submit(call, request)
        try:
            async for event in stream:
                if isinstance(event, Finished):
                    call.engine_metrics, call.finish_reason = event.metrics, event.finish_reason
                    return event
        finally:
            stream.cancel()  # frees the request if this handler is cancelled; else a no-op
        raise EngineError(ErrorCode.INTERNAL, "the engine ended the request without a result")

    async def _text(
        self, call: _Call, request: GenerationRequest, wrap: Callable[..., Any]
    ) -> AsyncIterator[Any]:
        """Run a text request: a message per delta, then the final one."""
        stream = await self._submit(call, request)
        try:
            async for event in stream:
                if isinstance(event, TextDelta):
                    if call.first_token is None:
                        call.first_token = time.perf_counter()
                    yield wrap(delta=pb.TextDelta(text=event.text))
                elif isinstance(event, Finished):
                    call.engine_metrics, call.finish_reason = event.metrics, event.finish_reason
                    if call.first_token is None:
                        call.first_token = time.perf_counter()
                    yield wrap(result=convert.text_result(event, call.elapsed_ms()))
                    return
        finally:
            stream.cancel()
        raise EngineError(ErrorCode.INTERNAL, "the engine ended the request without a result")

    def _request(
        self, call: _Call, task: Task, settings: pb.GenerationSettings, **fields: Any
    ) -> GenerationRequest:
        """Check the settings and build the engine request (the image is set later)."""
        s = validation.settings(settings, self._max_tokens(call.engine()))
        return GenerationRequest(
            task=task,
            image=None,
            request_id=call.request_id,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_tokens,
            max_objects=s.max_objects,
            seed=s.seed,
            deadline=call.deadline(),
            **fields,
        )

    async def _with_image(
        self, gen: GenerationRequest, request: Any, required: bool = True
    ) -> GenerationRequest:
        # Decoding is the expensive check, so it comes after all the cheap ones.
        image = await self.images.resolve(request, required=required)
        return dataclasses.replace(gen, image=image)

    # ---- RPCs -------------------------------------------------------------------------

    async def Caption(
        self, request: pb.CaptionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CaptionResponse]:
        async with self._call(Task.CAPTION, context) as call:
            gen = self._request(
                call,
                Task.CAPTION,
                request.settings,
                caption_length=validation.caption_length(request.length),
            )
            gen = await self._with_image(gen, request)
            async for message in self._text(call, gen, pb.CaptionResponse):
                yield message

    async def Query(
        self, request: pb.QueryRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.QueryResponse]:
        async with self._call(Task.QUERY, context) as call:
            gen = self._request(
                call,
                Task.QUERY,
                request.settings,
                question=validation.question(request.question),
                choices=validation.choices(list(request.choices)),
                regex=request.regex if request.HasField("regex") else None,
            )
            gen = await self._with_image(gen, request, required=False)
            async for message in self._text(call, gen, pb.QueryResponse):
                yield message

    async def _object_task(
        self,
        task: Task,
        request: Any,
        context: grpc.aio.ServicerContext,
        respond: Callable[[Any, float], Any],
    ) -> Any:
        """Point, Detect and Segment: an object name, an image, one final answer."""
        async with self._call(task, context) as call:
            gen = self._request(
                call,
                task,
                request.settings,
                object_name=validation.object_name(request.object, self.limits.max_object_chars),
            )
            done = await self._final(call, await self._with_image(gen, request))
            return respond(done, call.elapsed_ms())

    async def Point(
        self, request: pb.PointRequest, context: grpc.aio.ServicerContext
    ) -> pb.PointResponse:
        return await self._object_task(Task.POINT, request, context, convert.point_response)

    async def Detect(
        self, request: pb.DetectRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetectResponse:
        return await self._object_task(Task.DETECT, request, context, convert.detect_response)

    async def Segment(
        self, request: pb.SegmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.SegmentResponse:
        return await self._object_task(Task.SEGMENT, request, context, convert.segment_response)

    async def EncodeImage(
        self, request: pb.EncodeImageRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncodeImageResponse:
        async with self._call("encode_image", context) as call:
            call.engine()
            owner = self.client_of(call)
            image = await self.images.decode(request.image_bytes)
            cache = self.images.cache
            image_id, present = cache.put(image, owner=owner)
            self.metrics.image_cache_bytes.set(cache.nbytes)
            return pb.EncodeImageResponse(
                image_id=image_id,
                width=image.width,
                height=image.height,
                num_crops=image.num_crops,
                already_cached=present,
            )

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        async with self._call("model_info", context) as call:
            if self.engine is None:
                call.engine()  # raises UNAVAILABLE: nothing to describe yet
            assert self.engine is not None
            info, lim = self.engine.info, self.limits
            return pb.GetModelInfoResponse(
                model_name=info.model_name,
                preset=info.preset,
                token_contract=info.token_contract,
                device=info.device,
                dtype=info.dtype,
                max_context=info.max_context,
                pipeline_depth=info.pipeline_depth,
                max_batch_size=info.max_batch_size,
                server_version=_server_version(),
                limits=pb.ServerLimits(
                    max_message_bytes=lim.max_message_bytes,
                    max_image_bytes=lim.max_image_bytes,
                    max_image_pixels=lim.max_image_pixels,
                    max_image_side=lim.max_image_side,
                    max_tokens=info.max_context,
                    max_queue=info.max_queue,
                    image_cache_bytes=lim.image_cache_bytes,
                ),
            )
