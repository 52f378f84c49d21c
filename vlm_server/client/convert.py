"""Python arguments -> request messages, response messages -> `types` dataclasses."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.client import types as t

ImageInput = bytes | str | os.PathLike[str] | t.EncodedImage
"""Encoded image bytes, a path to an image file, or an image uploaded with encode_image."""

CAPTION_LENGTHS = {
    "short": pb.CAPTION_LENGTH_SHORT,
    "normal": pb.CAPTION_LENGTH_NORMAL,
    "long": pb.CAPTION_LENGTH_LONG,
}
FINISH_REASONS = {
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_MAX_OBJECTS: "max_objects",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}
FIELD_METADATA_KEY = "vlm-field"
REQUEST_ID_METADATA_KEY = "vlm-request-id"


def image_fields(image: ImageInput | None) -> dict[str, Any]:
    """The request's ``image`` oneof for any accepted kind of image input."""
    if image is None:
        return {}
    if isinstance(image, t.EncodedImage):
        return {"image_id": image.image_id}
    if isinstance(image, bytes | bytearray | memoryview):
        return {"image_bytes": bytes(image)}
    return {"image_bytes": Path(image).read_bytes()}


class Settings(TypedDict, total=False):
    """Decode settings a call may give; the server applies its defaults to the others."""

    temperature: float  # >= 0; 0 = greedy
    top_p: float  # (0, 1]
    max_tokens: int  # caption, query (with reasoning: the reasoning's, and the answer's)
    max_objects: int  # point, detect
    seed: int
    adapter: str  # a finetune adapter (LoRA) by id; unset: the base model
    clip: bool  # detect, segment: clamp boxes (and polygons) to the picture; default False
    priority: int  # -10 .. 10, higher admitted first; below 0: background (batch) work


def settings(**values: Unpack[Settings]) -> pb.GenerationSettings:
    """Only the given (not None) values are set."""
    return pb.GenerationSettings(**{k: v for k, v in values.items() if v is not None})


def caption_length(length: str) -> int:
    try:
        return CAPTION_LENGTHS[length]
    except KeyError:
        raise ValueError(f"length must be short, normal or long, not {length!r}") from None


def metrics(m: pb.RequestMetrics) -> t.Metrics:
    return t.Metrics(
        queue_wait_ms=m.queue_wait_ms,
        time_to_first_token_ms=m.time_to_first_token_ms,
        prefill_ms=m.prefill_ms,
        decode_ms=m.decode_ms,
        total_ms=m.total_ms,
        input_tokens=m.input_tokens,
        output_tokens=m.output_tokens,
        cached_tokens=m.cached_tokens,
        intake_ms=m.intake_ms,
        prefix_wait_ms=m.prefix_wait_ms,
        reasoning_tokens=m.reasoning_tokens,
    )


def finish_reason(value: int) -> str:
    return FINISH_REASONS.get(value, "unspecified")


def point(p: pb.NormalizedPoint) -> t.Point:
    return t.Point(p.x_norm, p.y_norm)


def box(b: pb.NormalizedBox) -> t.Box:
    return t.Box(b.x_min_norm, b.y_min_norm, b.x_max_norm, b.y_max_norm)


def text_event(message: pb.CaptionResponse | pb.QueryResponse) -> t.TextDelta | t.TextResult:
    if message.WhichOneof("event") == "delta":
        return t.TextDelta(message.delta.text, message.delta.reasoning)
    r = message.result
    thought = None
    if r.HasField("reasoning"):
        spans = [
            t.GroundedSpan(g.start_idx, g.end_idx, [point(p) for p in g.points])
            for g in r.reasoning.grounding
        ]
        thought = t.Reasoning(r.reasoning.text, spans)
    return t.TextResult(r.text, finish_reason(r.finish_reason), metrics(r.metrics), thought)


SpatialRefs = Sequence[Sequence[float]]  # points [x, y] and boxes [x_min, y_min, x_max, y_max]


def spatial_refs(refs: SpatialRefs | None) -> list[pb.SpatialRef]:
    """The proto references of points and boxes (other lengths: ValueError)."""
    out = []
    for ref in refs or ():
        if len(ref) == 2:
            out.append(pb.SpatialRef(point=pb.NormalizedPoint(x_norm=ref[0], y_norm=ref[1])))
        elif len(ref) == 4:
            x0, y0, x1, y1 = ref
            box = pb.NormalizedBox(x_min_norm=x0, y_min_norm=y0, x_max_norm=x1, y_max_norm=y1)
            out.append(pb.SpatialRef(box=box))
        else:
            raise ValueError(f"a spatial reference is [x, y] or a box of 4 numbers, got {ref}")
    return out


def point_result(r: pb.PointResponse) -> t.PointResult:
    return t.PointResult(
        [point(p) for p in r.points], finish_reason(r.finish_reason), metrics(r.metrics)
    )


def detect_result(r: pb.DetectResponse) -> t.DetectResult:
    return t.DetectResult(
        [box(b) for b in r.boxes], finish_reason(r.finish_reason), metrics(r.metrics)
    )


def segment_result(r: pb.SegmentResponse) -> t.SegmentResult:
    return t.SegmentResult(
        box=box(r.box),
        svg_path=r.svg_path,
        polygons=[[point(p) for p in poly.points] for poly in r.polygons],
        mask=t.RleMask(list(r.mask.counts), r.mask.height, r.mask.width),
        finish_reason=finish_reason(r.finish_reason),
        metrics=metrics(r.metrics),
    )


def encoded_image(r: pb.EncodeImageResponse) -> t.EncodedImage:
    return t.EncodedImage(r.image_id, r.width, r.height, r.num_crops, r.already_cached)


def model_info(r: pb.GetModelInfoResponse) -> t.ModelInfo:
    lim = r.limits
    return t.ModelInfo(
        model_name=r.model_name,
        preset=r.preset,
        token_contract=r.token_contract,
        device=r.device,
        dtype=r.dtype,
        max_context=r.max_context,
        pipeline_depth=r.pipeline_depth,
        max_batch_size=r.max_batch_size,
        server_version=r.server_version,
        max_message_bytes=lim.max_message_bytes,
        max_image_bytes=lim.max_image_bytes,
        max_image_pixels=lim.max_image_pixels,
        max_image_side=lim.max_image_side,
        max_tokens=lim.max_tokens,
        max_queue=lim.max_queue,
        image_cache_bytes=lim.image_cache_bytes,
        max_step_tokens=r.max_step_tokens,
        max_object_chars=lim.max_object_chars,
        max_question_chars=lim.max_question_chars,
        max_choices=lim.max_choices,
        max_choice_chars=lim.max_choice_chars,
        max_regex_chars=lim.max_regex_chars,
    )


def error(err: grpc.RpcError) -> t.VlmError:
    """A `VlmError` from a failed call (sync or asyncio)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    meta = dict(trailing or ())
    return t.VlmError(
        code, details, meta.get(FIELD_METADATA_KEY), meta.get(REQUEST_ID_METADATA_KEY)
    )


def caption_request(
    image: ImageInput, length: str, gen: pb.GenerationSettings
) -> pb.CaptionRequest:
    return pb.CaptionRequest(length=caption_length(length), settings=gen, **image_fields(image))


def query_request(
    image: ImageInput | None,
    question: str,
    choices: list[str] | None,
    regex: str | None,
    gen: pb.GenerationSettings,
    reasoning: bool = False,
    refs: SpatialRefs | None = None,
) -> pb.QueryRequest:
    extra = {} if regex is None else {"regex": regex}
    return pb.QueryRequest(
        question=question,
        choices=list(choices or ()),
        settings=gen,
        reasoning=reasoning,
        spatial_refs=spatial_refs(refs),
        **extra,
        **image_fields(image),
    )


def object_request(
    kind: type[Any],
    image: ImageInput,
    obj: str,
    gen: pb.GenerationSettings,
    refs: SpatialRefs | None = None,
) -> Any:
    """A Point, Detect or Segment request (they share one shape)."""
    return kind(object=obj, settings=gen, spatial_refs=spatial_refs(refs), **image_fields(image))
