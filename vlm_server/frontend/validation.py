"""Checks of request fields that need no model: ranges, empty strings, enum values.

Errors are INVALID_ARGUMENT with a message that starts with the proto field's path. Checks
that depend on the model (context length, regex against the vocabulary) or on the task (whether
it needs an image) are the request compiler's (vlm_server/engine/requests/tasks.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.api import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    EngineError,
    ErrorCode,
    GenerationRequest,
    Task,
)
from vlm_server.frontend.refusals import invalid
from vlm_server.models.lora.files import AdapterError, check_id

_DEFAULTS = GenerationRequest(task=Task.CAPTION, image=None)

CAPTION_LENGTHS = {
    pb.CAPTION_LENGTH_UNSPECIFIED: "normal",
    pb.CAPTION_LENGTH_SHORT: "short",
    pb.CAPTION_LENGTH_NORMAL: "normal",
    pb.CAPTION_LENGTH_LONG: "long",
}
# Questions: far beyond any context anyway (the server's --max-question-chars).
MAX_QUESTION_CHARS = 16_384
# Object names are a few words; a long one would crowd the answer out of the context, and the
# engine would blame settings.max_objects (the server's --max-object-chars).
MAX_OBJECT_CHARS = 256


@dataclass(frozen=True)
class Settings:
    temperature: float
    top_p: float
    max_tokens: int
    max_objects: int
    seed: int
    adapter: str | None = None
    priority: int = 0


def settings(msg: pb.GenerationSettings, max_tokens_limit: int) -> Settings:
    """Apply defaults to unset fields and check every value's range."""
    temperature = msg.temperature if msg.HasField("temperature") else _DEFAULTS.temperature
    top_p = msg.top_p if msg.HasField("top_p") else _DEFAULTS.top_p
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else _DEFAULTS.max_tokens
    max_objects = msg.max_objects if msg.HasField("max_objects") else _DEFAULTS.max_objects
    seed = msg.seed if msg.HasField("seed") else _DEFAULTS.seed
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid("settings.temperature", f"must be >= 0, got {temperature}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise invalid("settings.top_p", f"must be in (0, 1], got {top_p}")
    # The default may exceed a small model's context; only an explicit value is an error, and
    # the request compiler owns that check (it knows the context).
    if not msg.HasField("max_tokens"):
        max_tokens = min(max_tokens, max_tokens_limit)
    if max_tokens < 1:
        raise invalid("settings.max_tokens", f"must be >= 1, got {max_tokens}")
    if max_objects < 1:
        raise invalid("settings.max_objects", f"must be >= 1, got {max_objects}")
    adapter = msg.adapter if msg.HasField("adapter") and msg.adapter else None
    if adapter is not None and "/" in adapter:
        # HTTP's model spelling: here the server's model is implied, so only the id is sent.
        base, _, name = adapter.rpartition("/")
        raise invalid(
            "settings.adapter",
            f"takes the adapter id alone ({name[:64]!r}), not <model>/<id> ({base[:64]!r}/...)",
        )
    if adapter is not None:
        try:
            check_id(adapter)
        except AdapterError as err:
            raise invalid("settings.adapter", str(err)) from None
    return Settings(temperature, top_p, max_tokens, max_objects, seed, adapter, priority(msg))


def priority(msg: pb.GenerationSettings) -> int:
    """``settings.priority``, default 0 (interactive)."""
    if not msg.HasField("priority"):
        return _DEFAULTS.priority
    return check_priority(msg.priority, "settings.priority")


def check_priority(value: int, field: str) -> int:
    """``value`` if in MIN_PRIORITY .. MAX_PRIORITY, else INVALID_ARGUMENT naming ``field``
    (the HTTP door checks its JSON integer before the proto's int32 would refuse it)."""
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise invalid(field, f"must be in {MIN_PRIORITY}..{MAX_PRIORITY}, got {str(value)[:40]}")
    return value


def clip(task: Task, msg: pb.GenerationSettings) -> bool:
    """``settings.clip``: only detect and segment answer boxes to clamp (set on another
    task, even to false, it is refused rather than silently ignored)."""
    if not msg.HasField("clip"):
        return False
    if task not in (Task.DETECT, Task.SEGMENT):
        raise invalid("settings.clip", f"only detect and segment take clip, not {task}")
    return msg.clip


def caption_length(value: int) -> str:
    try:
        return CAPTION_LENGTHS[value]
    except KeyError:
        raise invalid("length", f"unknown caption length {value}") from None


def object_name(text: str, max_chars: int = MAX_OBJECT_CHARS) -> str:
    name = text.strip()
    if not name:
        raise invalid("object", "must not be empty")
    if len(name) > max_chars:
        raise invalid("object", f"is {len(name)} characters long; at most {max_chars}")
    return name


def question(text: str, max_chars: int = MAX_QUESTION_CHARS) -> str:
    if not text.strip():
        raise invalid("question", "must not be empty")
    if len(text) > max_chars:
        raise invalid("question", f"is {len(text)} characters long; at most {max_chars}")
    return text


def spatial_refs(refs: list[pb.SpatialRef], max_refs: int) -> tuple[tuple[float, ...], ...]:
    """Points (x, y) and boxes (x_min, y_min, x_max, y_max), each normalized to [0, 1],
    boxes ordered; ``max_refs`` of them at most (0: the engine's own bound decides)."""
    if max_refs and len(refs) > max_refs:
        raise invalid("spatial_refs", f"{len(refs)} references; at most {max_refs}")
    out: list[tuple[float, ...]] = []
    for i, ref in enumerate(refs):
        kind = ref.WhichOneof("ref")
        where = f"spatial_refs[{i}]"
        if kind == "point":
            values: tuple[float, ...] = (ref.point.x_norm, ref.point.y_norm)
        elif kind == "box":
            b = ref.box
            values = (b.x_min_norm, b.y_min_norm, b.x_max_norm, b.y_max_norm)
        else:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                f"spatial_refs: {where} is neither a point nor a box",
                "spatial_refs",
            )
        if not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values):
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                f"spatial_refs: {where} must be normalized to [0, 1], got {list(values)}",
                "spatial_refs",
            )
        if kind == "box" and (values[0] > values[2] or values[1] > values[3]):
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                f"spatial_refs: {where} must be ordered (x_min <= x_max, y_min <= y_max), "
                f"got {list(values)}",
                "spatial_refs",
            )
        out.append(values)
    return tuple(out)


def choices(values: list[str]) -> tuple[str, ...]:
    # Their number and sizes are the request compiler's limits (decoding/limits.py).
    if any(not v for v in values):
        raise invalid("choices", "must not contain an empty string")
    return tuple(values)
