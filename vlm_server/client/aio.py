"""asyncio client: the methods of `VisionLanguageClient`, awaitable; streams are async."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Unpack

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import convert
from vlm_server.client import types as t
from vlm_server.client.convert import ImageInput, Settings
from vlm_server.client.security import Security
from vlm_server.client.sync import DEFAULT_MAX_RECEIVE_BYTES, DEFAULT_TARGET, channel_options


class AsyncVisionLanguageClient:
    """asyncio twin of `VisionLanguageClient`; create and use it inside one event loop."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
        security: Security | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        security = security or Security()
        self._metadata = security.metadata()
        options = channel_options(max_receive_bytes)
        credentials = security.credentials()
        self._channel = (
            grpc.aio.insecure_channel(target, options=options)
            if credentials is None
            else grpc.aio.secure_channel(target, credentials, options=options)
        )
        self._stub = pb_grpc.VisionLanguageStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncVisionLanguageClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise convert.error(err) from None

    async def _stream(
        self, method: Any, request: Any, timeout: float | None
    ) -> AsyncIterator[t.TextDelta | t.TextResult]:
        call = method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            async for message in call:
                yield convert.text_event(message)
        except grpc.RpcError as err:
            raise convert.error(err) from None
        finally:
            call.cancel()  # a no-op once the call has finished

    @staticmethod
    async def _collect(events: AsyncIterator[t.TextDelta | t.TextResult]) -> t.TextResult:
        async for event in events:
            if isinstance(event, t.TextResult):
                return event
        raise t.VlmError(grpc.StatusCode.INTERNAL, "the stream ended without a result")

    def caption_stream(
        self,
        image: ImageInput,
        length: str = "normal",
        *,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[t.TextDelta | t.TextResult]:
        """Text deltas as they are generated, then the `TextResult`."""
        request = convert.caption_request(image, length, convert.settings(**settings))
        return self._stream(self._stub.Caption, request, timeout)

    async def caption(
        self,
        image: ImageInput,
        length: str = "normal",
        *,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.TextResult:
        """Caption ``image`` (short, normal or long)."""
        return await self._collect(self.caption_stream(image, length, timeout=timeout, **settings))

    def query_stream(
        self,
        image: ImageInput | None,
        question: str,
        *,
        choices: list[str] | None = None,
        regex: str | None = None,
        reasoning: bool = False,
        spatial_refs: convert.SpatialRefs | None = None,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[t.TextDelta | t.TextResult]:
        """Like `query`, streamed."""
        request = convert.query_request(
            image, question, choices, regex, convert.settings(**settings), reasoning, spatial_refs
        )
        return self._stream(self._stub.Query, request, timeout)

    async def query(
        self,
        image: ImageInput | None,
        question: str,
        *,
        choices: list[str] | None = None,
        regex: str | None = None,
        reasoning: bool = False,
        spatial_refs: convert.SpatialRefs | None = None,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.TextResult:
        """Answer ``question`` about ``image`` (None: text only), optionally constrained."""
        return await self._collect(
            self.query_stream(
                image,
                question,
                choices=choices,
                regex=regex,
                reasoning=reasoning,
                spatial_refs=spatial_refs,
                timeout=timeout,
                **settings,
            )
        )

    async def point(
        self,
        image: ImageInput,
        obj: str,
        *,
        spatial_refs: convert.SpatialRefs | None = None,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.PointResult:
        """Points at each ``obj`` in ``image``."""
        request = convert.object_request(
            pb.PointRequest, image, obj, convert.settings(**settings), spatial_refs
        )
        return convert.point_result(await self._unary(self._stub.Point, request, timeout))

    async def detect(
        self,
        image: ImageInput,
        obj: str,
        *,
        spatial_refs: convert.SpatialRefs | None = None,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.DetectResult:
        """Boxes around each ``obj`` in ``image``: the decoded centre plus and minus half
        the size, possibly past the picture's edges (``clip=True`` clamps them to [0, 1])."""
        request = convert.object_request(
            pb.DetectRequest, image, obj, convert.settings(**settings), spatial_refs
        )
        return convert.detect_result(await self._unary(self._stub.Detect, request, timeout))

    async def segment(
        self,
        image: ImageInput,
        obj: str,
        *,
        spatial_refs: convert.SpatialRefs | None = None,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.SegmentResult:
        """Outline of ``obj``: box, SVG path, polygons and RLE mask. The box may pass the
        picture's edges; ``clip=True`` clamps it and the polygons to [0, 1]."""
        request = convert.object_request(
            pb.SegmentRequest, image, obj, convert.settings(**settings), spatial_refs
        )
        return convert.segment_result(await self._unary(self._stub.Segment, request, timeout))

    async def encode_image(
        self, image: ImageInput, *, timeout: float | None = None
    ) -> t.EncodedImage:
        """Upload once; pass the result as the image of later calls."""
        if isinstance(image, t.EncodedImage):
            return image
        request = pb.EncodeImageRequest(**convert.image_fields(image))
        return convert.encoded_image(await self._unary(self._stub.EncodeImage, request, timeout))

    async def model_info(self, *, timeout: float | None = None) -> t.ModelInfo:
        """The served model and the server's limits."""
        response = await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return convert.model_info(response)
