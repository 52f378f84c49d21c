"""The engine's asyncio-facing contract, shared by every engine implementation.

The gRPC service talks only to this: `Engine.submit` admits a request (or raises an
`EngineError` with a status-like code), and the returned `RequestStream` yields events until
one `Finished` (or raises the `EngineError` that ended it). Engines run the model on their own
thread; events cross to the event loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the API stays torch-free: the engine core imports it
    from image_pipeline import EncodedImage, HostImage, PreparedImage
    from vlm_server.gc_pauses import GcPauseTotals


# GenerationRequest.priority: higher is admitted first. Clients may send -10..10; below 0 is
# background work (batch jobs submit at BATCH_PRIORITY), held within limits that keep room for
# interactive requests arriving later (docs/architecture.md, Priorities).
MIN_PRIORITY = -10
MAX_PRIORITY = 10
BATCH_PRIORITY = MIN_PRIORITY


class Task(enum.StrEnum):
    CAPTION = "caption"
    QUERY = "query"
    POINT = "point"
    DETECT = "detect"
    SEGMENT = "segment"


class FinishReason(enum.StrEnum):
    """Why a request ended with a result (errors, cancellation included, end with EngineError)."""

    EOS = "eos"  # the model ended the answer
    LENGTH = "length"  # max_tokens reached
    MAX_OBJECTS = "max_objects"  # point / detect: max_objects reached


class ErrorCode(enum.StrEnum):
    """Mirrors the gRPC status codes the service answers with."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"


class EngineError(Exception):
    """A request the engine refused or could not finish; ``field`` names the culprit input."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __reduce__(self) -> tuple[type[EngineError], tuple[ErrorCode, str, str | None]]:
        # Exceptions pickle as cls(*args); this one crosses to the server from an engine
        # process with all three.
        return (EngineError, (self.code, self.message, self.field))


@dataclass(frozen=True)
class GenerationRequest:
    """One task on one image. Coordinates in results are normalized to the image (origin
    top-left); boxes may extend past [0, 1] unless ``clip``."""

    task: Task
    # A HostImage is cropped by the engine; an EncodedImage decoded by its process first.
    image: PreparedImage | HostImage | EncodedImage | None
    request_id: str = ""
    caption_length: str = "normal"  # caption: short | normal | long
    question: str = ""  # query
    object_name: str = ""  # point, detect, segment
    temperature: float = 0.5
    top_p: float = 0.3
    max_tokens: int = 768
    max_objects: int = 50
    seed: int = 0
    choices: tuple[str, ...] = ()  # query: answer must be exactly one of these
    regex: str | None = None  # query: answer must fully match this pattern
    deadline: float | None = None  # time.monotonic() value; None = no deadline
    reasoning: bool = False  # query: grounded reasoning first, then the answer
    # Points (x, y) and boxes (x_min, y_min, x_max, y_max), normalized, in the prompt.
    spatial_refs: tuple[tuple[float, ...], ...] = ()
    adapter: str | None = None  # finetune adapter id; None = the base model
    # query: a chat's earlier turns, (prompts.USER or prompts.ASSISTANT, text), before the
    # question (models/prompts.py renders them).
    history: tuple[tuple[str, str], ...] = ()
    # Detect and segment: clamp boxes (segment: polygons too) to the picture; else a box is
    # the decoded centre plus and minus half the size, and may extend past the picture.
    clip: bool = False
    # Admission order: higher first, the oldest first within one priority; below 0 is
    # background work (MIN_PRIORITY .. MAX_PRIORITY; the service checks the range).
    priority: int = 0


@dataclass
class RequestMetrics:
    queue_wait_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    prefill_ms: float = 0.0
    prefix_wait_ms: float = 0.0  # admitted until its image prefix was ready (0: cached)
    decode_ms: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0  # a query with reasoning: both phases' tokens
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of output_tokens, the reasoning's (the marker not counted)


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
class Segmentation:
    box: Box
    svg_path: str  # in image-normalized coordinates
    polygons: tuple[tuple[Point, ...], ...]
    mask_rle: tuple[int, ...]  # COCO-style counts, column-major, at (mask_height, mask_width)
    mask_height: int
    mask_width: int
    # The path in the box's own frame (0 to 1 across the box), as Moondream's API answers it
    # and `PathDelta` streams it; None where the model writes its path in image coordinates.
    box_path: str | None = None


@dataclass(frozen=True)
class TextDelta:
    """Newly decoded text (never half a character) for caption and query: one token's, or
    several tokens' when the reader fell behind (`stream_events`). ``reasoning``: part of a
    query's reasoning, not of its answer."""

    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class PathDelta:
    """A segment outline as it decodes (Moondream 3): ``box`` once, when the path begins, then
    the path's text in the box's frame (`Segmentation.box_path`), one completed command (or
    group of its arguments) at a time, each after the first starting with its joining space;
    several when the reader fell behind (`stream_events`)."""

    chunk: str = ""
    box: Box | None = None


@dataclass(frozen=True)
class GroundedSpan:
    """Characters [start_idx, end_idx) of the reasoning text and the points grounding them."""

    start_idx: int
    end_idx: int
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Reasoning:
    """What a query with reasoning thought before it answered."""

    text: str
    grounding: tuple[GroundedSpan, ...] = ()


@dataclass
class Finished:
    finish_reason: FinishReason
    text: str | None = None
    points: list[Point] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    segmentation: Segmentation | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    reasoning: Reasoning | None = None  # a query with reasoning


Delta = TextDelta | PathDelta  # what a request streams before its result
Event = TextDelta | PathDelta | Finished  # what a request's stream yields
Emitted = TextDelta | PathDelta | Finished | EngineError  # the scheduler's: an error ends it


async def stream_events(queue: asyncio.Queue[Emitted]) -> AsyncIterator[Event]:
    """A request's events as its reader takes them from ``queue``, up to its `Finished`;
    raises the `EngineError` that ended it.

    Text (or path) deltas that queued up while the reader was busy come out merged into one:
    a reader that keeps up gets every delta as it was made, one that fell behind (a loop
    streaming thousands of messages a second) gets fewer, longer messages instead of an ever
    longer queue. Nothing is held back to merge."""
    held: Emitted | None = None
    while True:
        event = held if held is not None else await queue.get()
        held = None
        if isinstance(event, TextDelta) and not queue.empty():
            parts = [event.text]
            while not queue.empty():
                following = queue.get_nowait()
                # Reasoning and answer text stay apart: a client tells them by the flag.
                if not isinstance(following, TextDelta) or following.reasoning != event.reasoning:
                    held = following
                    break
                parts.append(following.text)
            event = TextDelta("".join(parts), event.reasoning)
        elif isinstance(event, PathDelta) and not queue.empty():
            parts, box = [event.chunk], event.box
            while not queue.empty():
                following = queue.get_nowait()
                if not isinstance(following, PathDelta):
                    held = following
                    break
                parts.append(following.chunk)
                box = box or following.box
            event = PathDelta("".join(parts), box)
        if isinstance(event, EngineError):
            raise event
        yield event
        if isinstance(event, Finished):
            return


class RequestStream(Protocol):
    def __aiter__(self) -> AsyncIterator[Event]: ...

    def cancel(self) -> None:
        """Stop the request; its resources are freed once no in-flight step uses them."""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    preset: str
    token_contract: str
    device: str
    dtype: str
    pipeline_depth: int
    max_batch_size: int
    max_context: int
    max_queue: int
    max_step_tokens: int = 0  # tokens of one step: decode rows + prompt chunks
    # Caps on a query's constraint (decoding/limits.py), enforced by the engine.
    max_choices: int = 0
    max_choice_chars: int = 0
    max_regex_chars: int = 0
    max_spatial_refs: int = 0  # spatial references of one request
    # Finetune adapters: slots on the device and the largest rank (0: adapters are off).
    max_adapters: int = 0
    max_adapter_rank: int = 0


# Buckets (ms) of EngineStats.step_interval_counts: a decode period (~1.5-5 ms) finely, a stall
# (an image prefix beside the steps, a long prompt chunk) coarsely.
STEP_INTERVAL_BOUNDS_MS = (
    0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0,
    250.0, 1000.0,
)  # fmt: skip


@dataclass
class EngineStats:
    queue_depth: int = 0
    active_sequences: int = 0
    kv_pages_in_use: int = 0
    kv_pages_total: int = 0
    last_batch_size: int = 0
    last_step_ms: float = 0.0
    prefix_hits: int = 0
    prefix_lookups: int = 0
    # Intervals between the commits of steps that carried decode rows: the inter-token gaps of
    # running streams as the server makes them. Counts per STEP_INTERVAL_BOUNDS_MS bucket
    # (values <= the bound; one more for everything above), and their sum.
    step_interval_counts: tuple[int, ...] = ()
    step_interval_sum_ms: float = 0.0
    # Garbage-collection pauses of the engine's own process (None: it runs in the server's,
    # whose pauses the server counts itself).
    gc_pauses: GcPauseTotals | None = None
    # Requests whose JPEG an engine process is decoding or will decode before admitting them
    # (they are in no queue_depth yet).
    images_decoding: int = 0
    # (id, rank) of the finetune adapters resident on the device, most recently used first.
    adapters: tuple[tuple[str, int], ...] = ()


class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None:
        """Load/warm up; returns when the engine can take requests."""

    async def submit(self, request: GenerationRequest) -> RequestStream:
        """Admit a request without blocking the loop; raises EngineError when it cannot be taken."""

    def stats(self) -> EngineStats: ...

    def warm_constraints(self) -> None:
        """Start what the first constrained request would otherwise wait for (the constraint
        compiler's child process), in the background; servers call this once ready."""

    def watch_events_delay(self, observe: Callable[[float], None]) -> None:
        """Have ``observe`` called with the seconds each tick's events spend between the
        engine and their streams, where they cross a process boundary (an engine in the
        server's process never calls it)."""

    def failure(self) -> str | None:
        """Why the engine can no longer serve (it failed or its process died), or None."""

    async def drain(self, timeout: float) -> None:
        """Refuse new requests (UNAVAILABLE) and wait until accepted ones finish."""

    async def close(self) -> None: ...
