"""Plain results of the client: no protobuf types leak out of the client package.

Coordinates are normalized to the image (0 and 1 are its edges), origin top-left. Points lie
in [0, 1]; a detected or segmented box is the decoded centre plus and minus half the decoded
size, as the model's reference returns it, so it may extend past the picture (below 0 or above
1) unless the call passed ``clip=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True)
class Metrics:
    queue_wait_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    intake_ms: float = 0.0  # on the server before the engine: checks, image decode
    prefix_wait_ms: float = 0.0  # admitted until the image prefix was ready (0: cached)
    reasoning_tokens: int = 0  # of output_tokens, a reasoning query's reasoning


@dataclass(frozen=True)
class Point:
    x: float
    y: float


@dataclass(frozen=True)
class Box:
    x_min: float
    y_min: float
    x_max: float
    y_max: float


@dataclass(frozen=True)
class TextDelta:
    """A piece of streamed text; all pieces together make the final text. ``reasoning``:
    a piece of a query's reasoning (those all come first), not of its answer."""

    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class GroundedSpan:
    """Characters [start_idx, end_idx) of the reasoning and the points grounding them."""

    start_idx: int
    end_idx: int
    points: list[Point]


@dataclass(frozen=True)
class Reasoning:
    text: str
    grounding: list[GroundedSpan] = field(default_factory=list)


@dataclass(frozen=True)
class TextResult:
    text: str
    finish_reason: str  # eos | length | cancelled
    metrics: Metrics = field(default_factory=Metrics)
    reasoning: Reasoning | None = None  # a query with reasoning=True


@dataclass(frozen=True)
class PointResult:
    points: list[Point]
    finish_reason: str  # eos | max_objects
    metrics: Metrics = field(default_factory=Metrics)


@dataclass(frozen=True)
class DetectResult:
    boxes: list[Box]
    finish_reason: str
    metrics: Metrics = field(default_factory=Metrics)


@dataclass(frozen=True)
class RleMask:
    """COCO RLE: column-major runs, alternating background / foreground, background first."""

    counts: list[int]
    height: int
    width: int


@dataclass(frozen=True)
class SegmentResult:
    box: Box
    svg_path: str  # normalized coordinates
    polygons: list[list[Point]]
    mask: RleMask
    finish_reason: str
    metrics: Metrics = field(default_factory=Metrics)


@dataclass(frozen=True)
class EncodedImage:
    """An uploaded image; pass it wherever an image is expected instead of the bytes."""

    image_id: str
    width: int
    height: int
    num_crops: int
    already_cached: bool = False


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    preset: str
    token_contract: str
    device: str
    dtype: str
    max_context: int
    pipeline_depth: int
    max_batch_size: int
    server_version: str
    max_message_bytes: int
    max_image_bytes: int
    max_image_pixels: int
    max_image_side: int
    max_tokens: int
    max_queue: int
    image_cache_bytes: int
    max_step_tokens: int = 0
    max_object_chars: int = 0
    max_question_chars: int = 0
    max_choices: int = 0
    max_choice_chars: int = 0
    max_regex_chars: int = 0


class VlmError(Exception):
    """A call failed: ``code`` is the gRPC status, ``field`` the request field at fault."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.request_id = request_id
