"""The ``vlm.v1.VisionLanguage`` servicer: proto in, engine requests out, events back.

Engine-agnostic: it only uses the `Engine` protocol. Each RPC goes through `_Call`, the gRPC
side of the shared `calls.Call` (admission, UNAVAILABLE while loading or draining, metrics,
access log): it adds the request id to the trailing metadata and maps errors to status codes.
Requests are checked and built by `request_builder.build`, which the HTTP door shares.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.engine.api import (
    EngineError,
    Finished,
    GenerationRequest,
    RequestStream,
    Task,
    TextDelta,
)
from vlm_server.frontend import received
from vlm_server.frontend.calls import Call, Door, Limits, ServiceCore, request_id, status_code
from vlm_server.frontend.refusals import proto_field
from vlm_server.rpc import responses
from vlm_server.rpc.status import FIELD_METADATA_KEY, REQUEST_ID_METADATA_KEY, STATUS

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VisionLanguage"].full_name
CLIENT_REQUEST_ID_KEY = "x-request-id"

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

__all__ = ["RPC_TASKS", "SERVICE_NAME", "Limits", "VisionLanguageServicer"]


def server_version() -> str:
    try:
        return importlib.metadata.version("moondream-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cancel_if_alive(ref: weakref.ref[RequestStream]) -> None:
    stream = ref()
    if stream is not None:
        stream.cancel()


class _Call(Call):
    """A `Call` made by gRPC: trailing metadata, deadline from the context, status on error."""

    def __init__(self, core: ServiceCore, task: str, context: grpc.aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        super().__init__(
            core,
            Door.GRPC,
            task,
            _request_id(context),
            # Read now: after a client cancel the call's core object may be gone, and touching
            # the context then can crash the process.
            peer=context.peer(),
            deadline=None if remaining is None else time.monotonic() + remaining,
        )
        self.context = context

    async def __aenter__(self) -> _Call:
        await super().__aenter__()
        self.context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, self.request_id),))
        return self

    async def submit(self, request: GenerationRequest) -> RequestStream:
        stream = await super().submit(request)
        # Frees the engine's request when the RPC ends for any reason (client cancel,
        # deadline), without waiting for the handler's generator to be finalized. Weakly:
        # gRPC's call state sits in a reference cycle, and a strong reference would keep the
        # request (its image, crops) alive until the next garbage collection.
        ref = weakref.ref(stream)
        self.context.add_done_callback(lambda _: _cancel_if_alive(ref))
        return stream

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        await super().__aexit__(exc_type, exc, tb)
        if isinstance(exc, EngineError):
            trailing: tuple[tuple[str, str], ...] = ((REQUEST_ID_METADATA_KEY, self.request_id),)
            field = proto_field(exc.field)
            message = exc.message
            if field:
                trailing += ((FIELD_METADATA_KEY, field),)
                if exc.field and exc.field != field and message.startswith(f"{exc.field}:"):
                    message = field + message[len(exc.field) :]  # the name clients know
            await self.context.abort(STATUS[exc.code], message, trailing_metadata=trailing)
        if status_code(exc) == "INTERNAL":
            await self.context.abort(
                grpc.StatusCode.INTERNAL, f"internal error (request id {self.request_id})"
            )
        return False


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_REQUEST_ID_KEY and isinstance(value, str):
            return request_id(value)
    return request_id(None)


class VisionLanguageServicer(pb_grpc.VisionLanguageServicer):
    """Implements every RPC of ``vlm.v1.VisionLanguage`` against the core's `Engine`."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def record_rejected(self, method: str, code: grpc.StatusCode, message: str) -> None:
        """A call refused before its handler ran (bad protobuf, no API key)."""
        self._record_early(method, code.name, {"error": message})

    def record_unstarted(
        self, method: str, code: str = "CANCELLED", client_id: str | None = None
    ) -> None:
        """A call that ended before its request was read: its deadline passed while the
        request was still arriving (DEADLINE_EXCEEDED), or its client went away (CANCELLED)."""
        fields = {"stage": "receiving", "request_id": request_id(client_id)}
        self._record_early(method, code, fields)

    def _record_early(self, method: str, code: str, fields: dict[str, Any]) -> None:
        service, _, name = method.lstrip("/").partition("/")
        if service == SERVICE_NAME and name in RPC_TASKS:
            self.core.record_early(Door.GRPC, RPC_TASKS[name], code, fields)

    def _call(self, task: str, context: grpc.aio.ServicerContext) -> _Call:
        return _Call(self.core, task, context)

    async def _text(
        self, call: _Call, request: GenerationRequest, wrap: Callable[..., Any]
    ) -> AsyncIterator[Any]:
        """Run a text request: a message per delta, then the final one."""
        async for event in call.events(await call.submit(request)):
            if isinstance(event, TextDelta):
                yield wrap(delta=pb.TextDelta(text=event.text, reasoning=event.reasoning))
            elif isinstance(event, Finished):
                call.answered = True  # the last message: the client may hang up once it has it
                yield wrap(result=responses.text_result(event, call.elapsed_ms(), call.intake_ms))

    # ---- RPCs -------------------------------------------------------------------------

    async def Caption(
        self, request: pb.CaptionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CaptionResponse]:
        async with self._call(Task.CAPTION, context) as call:
            gen = await call.build(request)
            async for message in self._text(call, gen, pb.CaptionResponse):
                yield message

    async def Query(
        self, request: pb.QueryRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.QueryResponse]:
        async with self._call(Task.QUERY, context) as call:
            gen = await call.build(request)
            async for message in self._text(call, gen, pb.QueryResponse):
                yield message

    async def _object_task(
        self,
        task: Task,
        request: Any,
        context: grpc.aio.ServicerContext,
        respond: Callable[[Any, float, float], Any],
    ) -> Any:
        """Point, Detect and Segment: an object name, an image, one final answer."""
        async with self._call(task, context) as call:
            done = await call.final(await call.build(request))
            return respond(done, call.elapsed_ms(), call.intake_ms)

    async def Point(
        self, request: pb.PointRequest, context: grpc.aio.ServicerContext
    ) -> pb.PointResponse:
        return await self._object_task(Task.POINT, request, context, responses.point_response)

    async def Detect(
        self, request: pb.DetectRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetectResponse:
        return await self._object_task(Task.DETECT, request, context, responses.detect_response)

    async def Segment(
        self, request: pb.SegmentRequest, context: grpc.aio.ServicerContext
    ) -> pb.SegmentResponse:
        return await self._object_task(Task.SEGMENT, request, context, responses.segment_response)

    async def EncodeImage(
        self, request: pb.EncodeImageRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncodeImageResponse:
        async with self._call("encode_image", context) as call:
            call.engine()
            images = self.core.images
            owner = self.core.client_of(context.invocation_metadata(), call.peer)
            image = await images.decode(received.image_bytes(request))
            image_id, present = images.cache.put(image, owner=owner)
            self.core.metrics.image_cache_bytes.set(images.cache.nbytes)
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
            engine = self.core.engine
            if engine is None:
                call.engine()  # raises UNAVAILABLE: nothing to describe yet
            assert engine is not None
            info, lim = engine.info, self.core.limits
            return pb.GetModelInfoResponse(
                model_name=info.model_name,
                preset=info.preset,
                token_contract=info.token_contract,
                device=info.device,
                dtype=info.dtype,
                max_context=info.max_context,
                pipeline_depth=info.pipeline_depth,
                max_batch_size=info.max_batch_size,
                server_version=server_version(),
                max_step_tokens=info.max_step_tokens,
                limits=pb.ServerLimits(**lim.describe(info)),
                adapters=[
                    pb.AdapterInfo(id=name, rank=rank, resident=True)
                    for name, rank in engine.stats().adapters
                ],
            )
