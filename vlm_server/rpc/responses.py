"""Engine results -> proto messages."""

from __future__ import annotations

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.api import Box, Finished, Point, RequestMetrics, Segmentation

FINISH_REASONS = {
    "eos": pb.FINISH_REASON_EOS,
    "length": pb.FINISH_REASON_LENGTH,
    "max_objects": pb.FINISH_REASON_MAX_OBJECTS,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}


def finish_reason(reason: str) -> int:
    return FINISH_REASONS.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def metrics(m: RequestMetrics, total_ms: float, intake_ms: float = 0.0) -> pb.RequestMetrics:
    """The engine's times and counts, with the server's (``total_ms``, ``intake_ms``)."""
    return pb.RequestMetrics(
        queue_wait_ms=m.queue_wait_ms,
        time_to_first_token_ms=m.time_to_first_token_ms,
        prefill_ms=m.prefill_ms,
        decode_ms=m.decode_ms,
        total_ms=total_ms,
        input_tokens=m.input_tokens,
        output_tokens=m.output_tokens,
        cached_tokens=m.cached_tokens,
        intake_ms=intake_ms,
        prefix_wait_ms=m.prefix_wait_ms,
        reasoning_tokens=m.reasoning_tokens,
    )


def point(p: Point) -> pb.NormalizedPoint:
    return pb.NormalizedPoint(x_norm=p.x, y_norm=p.y)


def box(b: Box) -> pb.NormalizedBox:
    return pb.NormalizedBox(
        x_min_norm=b.x_min, y_min_norm=b.y_min, x_max_norm=b.x_max, y_max_norm=b.y_max
    )


def text_result(done: Finished, total_ms: float, intake_ms: float = 0.0) -> pb.TextResult:
    result = pb.TextResult(
        text=done.text or "",
        finish_reason=finish_reason(done.finish_reason),
        metrics=metrics(done.metrics, total_ms, intake_ms),
    )
    if done.reasoning is not None:
        result.reasoning.text = done.reasoning.text
        for span in done.reasoning.grounding:
            result.reasoning.grounding.add(
                start_idx=span.start_idx,
                end_idx=span.end_idx,
                points=[point(p) for p in span.points],
            )
    return result


def point_response(done: Finished, total_ms: float, intake_ms: float = 0.0) -> pb.PointResponse:
    return pb.PointResponse(
        points=[point(p) for p in done.points],
        finish_reason=finish_reason(done.finish_reason),
        metrics=metrics(done.metrics, total_ms, intake_ms),
    )


def detect_response(done: Finished, total_ms: float, intake_ms: float = 0.0) -> pb.DetectResponse:
    return pb.DetectResponse(
        boxes=[box(b) for b in done.boxes],
        finish_reason=finish_reason(done.finish_reason),
        metrics=metrics(done.metrics, total_ms, intake_ms),
    )


def segment_response(done: Finished, total_ms: float, intake_ms: float = 0.0) -> pb.SegmentResponse:
    response = pb.SegmentResponse(
        finish_reason=finish_reason(done.finish_reason),
        metrics=metrics(done.metrics, total_ms, intake_ms),
    )
    seg: Segmentation | None = done.segmentation
    if seg is not None:
        response.box.CopyFrom(box(seg.box))
        response.svg_path = seg.svg_path
        for polygon in seg.polygons:
            response.polygons.add().points.extend(point(p) for p in polygon)
        response.mask.counts.extend(seg.mask_rle)
        response.mask.height = seg.mask_height
        response.mask.width = seg.mask_width
    return response
