"""Blocking client: one method per RPC, plain dataclasses out, `VlmError` on failure."""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any, Unpack

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import convert
from vlm_server.client import types as t
from vlm_server.client.convert import ImageInput, Settings
from vlm_server.client.security import Security

DEFAULT_TARGET = "localhost:50051"
DEFAULT_MAX_RECEIVE_BYTES = 32 << 20


def channel_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    # Only the receive side is capped: an oversized request should reach the server, whose
    # error states its own limit.
    return [("grpc.max_receive_message_length", max_receive_bytes)]


class VisionLanguageClient:
    """Talks to a ``vlm.v1.VisionLanguage`` server at ``target`` (``host:port``).

    ``timeout`` (seconds) is the default deadline of every call; each method takes its own.
    Streaming methods cancel the call when the caller stops iterating early. ``security``
    turns on TLS and sends an API key (`Security`).
    """

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
            grpc.insecure_channel(target, options=options)
            if credentials is None
            else grpc.secure_channel(target, credentials, options=options)
        )
        self._stub = pb_grpc.VisionLanguageStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> VisionLanguageClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise convert.error(err) from None

    def _stream(
        self, method: Any, request: Any, timeout: float | None
    ) -> Iterator[t.TextDelta | t.TextResult]:
        call = method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            for message in call:
                yield convert.text_event(message)
        except grpc.RpcError as err:
            raise convert.error(err) from None
        finally:
            call.cancel()  # a no-op once the call has finished

    @staticmethod
    def _collect(events: Iterator[t.TextDelta | t.TextResult]) -> t.TextResult:
        for event in events:
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
    ) -> Iterator[t.TextDelta | t.TextResult]:
        """Text deltas as they are generated, then the `TextResult`.

        ``settings``: temperature, top_p, max_tokens, seed (unset: server defaults).
        """
        request = convert.caption_request(image, length, convert.settings(**settings))
        return self._stream(self._stub.Caption, request, timeout)

    def caption(
        self,
        image: ImageInput,
        length: str = "normal",
        *,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.TextResult:
        """Caption ``image`` (short, normal or long)."""
        return self._collect(self.caption_stream(image, length, timeout=timeout, **settings))

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
    ) -> Iterator[t.TextDelta | t.TextResult]:
        """Like `query`, streamed."""
        request = convert.query_request(
            image, question, choices, regex, convert.settings(**settings), reasoning, spatial_refs
        )
        return self._stream(self._stub.Query, request, timeout)

    def query(
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
        return self._collect(
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

    def point(
        self,
        image: ImageInput,
        obj: str,
        *,
        spatial_refs: convert.SpatialRefs | None = None,
        timeout: float | None = None,
        **settings: Unpack[Settings],
    ) -> t.PointResult:
        """Points at each ``obj`` in ``image`` (``max_objects`` caps the count)."""
        request = convert.object_request(
            pb.PointRequest, image, obj, convert.settings(**settings), spatial_refs
        )
        return convert.point_result(self._unary(self._stub.Point, request, timeout))

    def detect(
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
        return convert.detect_result(self._unary(self._stub.Detect, request, timeout))

    def segment(
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
        return convert.segment_result(self._unary(self._stub.Segment, request, timeout))

    def encode_image(self, image: ImageInput, *, timeout: float | None = None) -> t.EncodedImage:
        """Upload once; pass the result as the image of later calls."""
        if isinstance(image, t.EncodedImage):
            return image
        request = pb.EncodeImageRequest(**convert.image_fields(image))
        return convert.encoded_image(self._unary(self._stub.EncodeImage, request, timeout))

    def model_info(self, *, timeout: float | None = None) -> t.ModelInfo:
        """The served model and the server's limits."""
        response = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return convert.model_info(response)
