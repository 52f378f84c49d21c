"""Moondream's HTTP API (``/v1/caption``, ``/query``, ``/point``, ``/detect``, ``/segment``),
wire-compatible with the official ``moondream`` clients.

Each handler checks the JSON's shape (`body.check`), translates it into the task's proto request
and hands that to the shared validation (`Call.build`), exactly as the gRPC door does. Streams
are server-sent events the official clients parse: ``{"chunk": ..., "completed": false}`` per
piece of text (``reasoning_chunk`` instead for a query's reasoning, which those clients skip),
then ``{"chunk": "", "completed": true, ...}`` (with ``reasoning``); segment streams ``bbox``,
``path_delta`` and ``final`` events: as the outline decodes where the model streams it
(Moondream 3: the box when its path begins, then one chunk per command), else all when it is
done. Answers carry ``request_id``, ``finish_reason`` and timing ``metrics``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.api import (
    BATCH_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Box,
    EngineError,
    ErrorCode,
    Finished,
    PathDelta,
    Segmentation,
    TextDelta,
)
from vlm_server.frontend import received, validation
from vlm_server.frontend.refusals import invalid
from vlm_server.http import adapter_names, data_url
from vlm_server.http.body import Field
from vlm_server.http.exchange import EventStream, Exchange

IMAGE_FIELD = "image_url"
# The shared validation names proto fields; these are the JSON names clients sent.
NAMES = {
    "image_bytes": IMAGE_FIELD,
    "image": IMAGE_FIELD,
    "image_id": IMAGE_FIELD,
    "settings.priority": "priority",
}
FINISH_REASONS = {"eos": "stop", "length": "length", "max_objects": "max_objects"}
CAPTION_LENGTHS = {
    "short": pb.CAPTION_LENGTH_SHORT,
    "normal": pb.CAPTION_LENGTH_NORMAL,
    "long": pb.CAPTION_LENGTH_LONG,
}
SETTING_NAMES = ("temperature", "top_p", "max_tokens", "max_objects", "seed", "clip")
SETTING_ALIASES = {"maxTokens": "max_tokens", "topP": "top_p", "maxObjects": "max_objects"}

# ---- request shapes ---------------------------------------------------------------------------

SETTINGS = Field(
    "settings",
    "object",
    "Sampling settings; unset ones take the server's defaults.",
    fields=(
        Field("temperature", "number", "Sampling temperature (0 = greedy)."),
        Field("top_p", "number", "Nucleus sampling mass, in (0, 1]."),
        Field(
            "max_tokens",
            "integer",
            "Most tokens to generate; a query with reasoning: most for the reasoning, and "
            "again for the answer.",
        ),
        Field("max_objects", "integer", "Most points or boxes (point, detect)."),
        Field("seed", "integer", "Sampling seed (an extension of this server)."),
        Field(
            "clip",
            "boolean",
            "Detect and segment: clamp boxes (segment: polygons too) to the picture, [0, 1] "
            "(default false: as decoded, possibly past it; an extension of this server).",
        ),
        Field("adapter", "string", "A finetune adapter to answer with (see model)."),
        Field("variant", "string", "A finetune adapter to answer with (see model)."),
        # The official npm client's spelling (it sends settings.maxTokens).
        *(
            Field(alias, "integer" if alias != "topP" else "number", f"Alias of {name}.")
            for alias, name in SETTING_ALIASES.items()
        ),
    ),
)
IMAGE = Field(
    IMAGE_FIELD,
    "string",
    "The picture as a base64 data URL (data:image/jpeg;base64,...); remote URLs are refused.",
    required=True,
)
MODEL = Field(
    "model",
    "string",
    "A name without '/' answers with the server's model; <base>/<finetune_id>@<step> (as the "
    "official clients send a finetune) with that adapter, where <base> must name the served "
    "model (see /v1/models).",
)
VARIANT = Field("variant", "string", "A finetune adapter to answer with (see model).")
PRIORITY = Field(
    "priority",
    "integer",
    f"Admission order, {MIN_PRIORITY} to {MAX_PRIORITY} (default 0): higher is admitted first. "
    f"Below 0 is background work (batch jobs send {BATCH_PRIORITY}), which leaves room for "
    "requests of 0 and above arriving later (an extension of this server).",
)
SPATIAL_REFS = Field(
    "spatial_refs",
    "array",
    "Points [x, y] and boxes [x_min, y_min, x_max, y_max] the request refers to, normalized "
    "to [0, 1].",
    items=Field("ref", "array", "[x, y] or [x1, y1, x2, y2]", items=Field("v", "number", "")),
)


def _stream(what: str, streams: bool) -> Field:
    if streams:
        return Field("stream", "boolean", f"Stream the {what} as server-sent events.")
    return Field(
        "stream",
        "boolean",
        "Must be false or absent.",
        unsupported=f"{what} answers once; it does not stream",
    )


def _object(what: str) -> Field:
    return Field("object", "string", f"What to {what}, e.g. 'car'.", required=True)


COMMON = (SETTINGS, MODEL, VARIANT, PRIORITY)
CAPTION = (
    IMAGE,
    Field("length", "string", "Caption length (default normal).", enum=tuple(CAPTION_LENGTHS)),
    _stream("caption", True),
    *COMMON,
)
QUERY = (
    Field(IMAGE.name, IMAGE.type, IMAGE.description + " Optional for a query."),
    Field("question", "string", "The question.", required=True),
    _stream("answer", True),
    Field(
        "reasoning",
        "boolean",
        "Think before answering (grounded reasoning); the answer then carries `reasoning`.",
    ),
    SPATIAL_REFS,
    Field(
        "choices",
        "array",
        "The answer must be exactly one of these (an extension of this server).",
        items=Field("choice", "string", ""),
    ),
    Field(
        "regex",
        "string",
        "The answer must fully match this pattern (an extension of this server).",
    ),
    *COMMON,
)
POINT = (IMAGE, _object("point at"), _stream("point", False), SPATIAL_REFS, *COMMON)
DETECT = (IMAGE, _object("find"), _stream("detect", False), SPATIAL_REFS, *COMMON)
SEGMENT = (IMAGE, _object("outline"), _stream("outline", True), SPATIAL_REFS, *COMMON)

# ---- response shapes (OpenAPI) ----------------------------------------------------------------

_NUMBER = {"type": "number"}
METRICS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Timings (milliseconds) and token counts of the request.",
    "properties": {
        name: {"type": "integer" if name.endswith("tokens") else "number"}
        for name in (
            "input_tokens",
            "output_tokens",
            "cached_tokens",
            "reasoning_tokens",
            "queue_time_ms",
            "prefill_time_ms",
            "ttft_ms",
            "decode_time_ms",
            "total_time_ms",
        )
    },
}
REGION_SCHEMA = {
    "type": "object",
    "description": "A box, normalized to the picture, origin top-left: the decoded centre "
    "plus and minus half the decoded size, so it may extend past the picture (below 0 or "
    "above 1) unless settings.clip is set.",
    "properties": {k: _NUMBER for k in ("x_min", "y_min", "x_max", "y_max")},
}
POINT_SCHEMA = {
    "type": "object",
    "description": "A point, normalized to [0, 1], origin top-left.",
    "properties": {"x": _NUMBER, "y": _NUMBER},
}


def answer_schema(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "request_id": {"type": "string"},
            key: schema,
            "finish_reason": {"type": "string", "enum": ["stop", "length", "max_objects"]},
            "metrics": METRICS_SCHEMA,
        },
    }


CAPTION_RESPONSE = answer_schema("caption", {"type": "string"})
QUERY_RESPONSE = answer_schema("answer", {"type": "string"})
QUERY_RESPONSE["properties"]["reasoning"] = {
    "type": "object",
    "description": "With `reasoning`: what the model thought, and the points it grounded "
    "spans of that text on ([start_idx, end_idx) character offsets).",
    "properties": {
        "text": {"type": "string"},
        "grounding": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "start_idx": {"type": "integer"},
                    "end_idx": {"type": "integer"},
                    "points": {"type": "array", "items": {"type": "array", "items": _NUMBER}},
                },
            },
        },
    },
}
POINT_RESPONSE = answer_schema("points", {"type": "array", "items": POINT_SCHEMA})
DETECT_RESPONSE = answer_schema("objects", {"type": "array", "items": REGION_SCHEMA})
SEGMENT_RESPONSE = answer_schema(
    "path",
    {
        "type": "string",
        "description": "SVG path data, normalized to bbox (0 to 1 across it: Moondream 3, as "
        "Moondream's API answers) or to the image (Moondream 2)",
    },
)
SEGMENT_RESPONSE["properties"]["bbox"] = REGION_SCHEMA

# ---- translation ------------------------------------------------------------------------------


def settings(values: dict[str, Any] | None) -> pb.GenerationSettings:
    """The proto settings of a JSON ``settings`` object (types already checked); a camelCase
    alias stands for its name unless both are sent with different values."""
    values = dict(values or {})
    for alias, name in SETTING_ALIASES.items():
        value = values.pop(alias, None)
        if value is None:
            continue
        if values.get(name) not in (None, value):
            raise invalid(f"settings.{alias}", f"differs from settings.{name}; send one of them")
        values[name] = value
    out = pb.GenerationSettings()
    for name in SETTING_NAMES:
        value = values.get(name)
        if value is None:
            continue
        try:
            setattr(out, name, value)
        except (ValueError, TypeError):  # an integer beyond the proto field's range
            if name in ("max_tokens", "max_objects"):  # as any count beyond the model
                raise EngineError(
                    ErrorCode.OUT_OF_RANGE,
                    f"settings.{name}: must be within the model's context, got {value}",
                    f"settings.{name}",
                ) from None
            raise invalid(f"settings.{name}", f"is out of range: {value}") from None
    return out


def priority(body: dict[str, Any], settings: pb.GenerationSettings) -> None:
    """The body's ``priority`` (an integer, checked) into ``settings.priority``; the route's
    `NAMES` name it ``priority`` in errors."""
    value = body.get("priority")
    if value is not None:
        # Checked here: beyond the proto's int32 setting it would fail without the range.
        settings.priority = validation.check_priority(value, "settings.priority")


def spatial_refs(message: Any, refs: list[list[float]] | None) -> None:
    """Add the JSON references (types already checked) to a proto request; their values
    are the shared validation's to check."""
    for i, ref in enumerate(refs or ()):
        if len(ref) == 2:
            point = pb.NormalizedPoint(x_norm=ref[0], y_norm=ref[1])
            message.spatial_refs.add().point.CopyFrom(point)
        elif len(ref) == 4:
            box = pb.NormalizedBox(
                x_min_norm=ref[0], y_min_norm=ref[1], x_max_norm=ref[2], y_max_norm=ref[3]
            )
            message.spatial_refs.add().box.CopyFrom(box)
        else:
            raise invalid(
                "spatial_refs",
                f"spatial_refs[{i}] must be a point [x, y] or a box [x_min, y_min, x_max, "
                f"y_max], got {len(ref)} numbers",
            )


def reasoning(done: Finished) -> dict[str, Any] | None:
    """The reference's shape of a query's reasoning (None without it)."""
    r = done.reasoning
    if r is None:
        return None
    return {
        "text": r.text,
        "grounding": [
            {
                "start_idx": g.start_idx,
                "end_idx": g.end_idx,
                "points": [[p.x, p.y] for p in g.points],
            }
            for g in r.grounding
        ],
    }


async def set_image(message: Any, url: str | None, field: str = IMAGE_FIELD) -> None:
    """The picture of ``url`` (a data URL), attached to ``message`` as its ``image_bytes``:
    setting the field would copy it on the event loop, and reading it back again."""
    if url is not None:
        received.attach(message, "image_bytes", await data_url.decode(url, field))


def metrics(done: Finished, total_ms: float, intake_ms: float = 0.0) -> dict[str, Any]:
    m = done.metrics
    return {
        "input_tokens": m.input_tokens,
        "output_tokens": m.output_tokens,
        "cached_tokens": m.cached_tokens,
        "reasoning_tokens": m.reasoning_tokens,
        "queue_time_ms": round(m.queue_wait_ms, 3),
        "prefill_time_ms": round(m.prefill_ms, 3),
        "ttft_ms": round(m.time_to_first_token_ms, 3),
        "decode_time_ms": round(m.decode_ms, 3),
        "total_time_ms": round(total_ms, 3),
        "intake_time_ms": round(intake_ms, 3),
        "prefix_wait_ms": round(m.prefix_wait_ms, 3),
    }


def finish_reason(done: Finished) -> str:
    return FINISH_REASONS.get(done.finish_reason, done.finish_reason)


def region(b: Box) -> dict[str, float]:
    return {"x_min": b.x_min, "y_min": b.y_min, "x_max": b.x_max, "y_max": b.y_max}


def _tail(ex: Exchange, done: Finished) -> dict[str, Any]:
    """What every answer ends with."""
    return {
        "request_id": ex.request_id,
        "finish_reason": finish_reason(done),
        "metrics": metrics(done, ex.active_call.elapsed_ms(), ex.active_call.intake_ms),
    }


# ---- handlers ---------------------------------------------------------------------------------


async def _text(ex: Exchange, message: Any, key: str, stream: bool) -> web.StreamResponse:
    """Run a caption or query; answer ``{key: text}`` or stream chunks then a completion."""
    call = ex.active_call
    submitted = await call.submit(await call.build(message))
    if not stream:
        done = await call.result(submitted)
        thought = reasoning(done)
        extra = {"reasoning": thought} if thought is not None else {}
        return ex.respond({key: done.text or "", **extra, **_tail(ex, done)})
    try:
        events = await ex.stream()
        async with contextlib.aclosing(call.events(submitted)) as produced:
            async for event in produced:
                if isinstance(event, TextDelta):
                    # Reasoning goes apart: the official clients stream `chunk` as the answer.
                    key_of = "reasoning_chunk" if event.reasoning else "chunk"
                    chunk = {key_of: event.text, "completed": False}
                    await events.send({**chunk, "request_id": ex.request_id})
                else:
                    thought = reasoning(event)
                    extra = {"reasoning": thought} if thought is not None else {}
                    end = {"chunk": "", "completed": True, **extra}
                    await events.send({**end, **_tail(ex, event)})
    finally:
        submitted.cancel()  # a no-op once finished; frees the request on any early exit
    await events.close()
    return events.response


async def caption(ex: Exchange) -> web.StreamResponse:
    ex.names = dict(NAMES)
    body = await ex.json(CAPTION)
    message = pb.CaptionRequest(
        length=CAPTION_LENGTHS[body.get("length") or "normal"],
        settings=settings(body.get("settings")),
    )
    adapter_names.apply(ex, body, message.settings)
    priority(body, message.settings)
    await set_image(message, body["image_url"])
    return await _text(ex, message, "caption", bool(body.get("stream")))


async def query(ex: Exchange) -> web.StreamResponse:
    ex.names = dict(NAMES)
    body = await ex.json(QUERY)
    message = pb.QueryRequest(
        question=body["question"],
        choices=body.get("choices") or (),
        settings=settings(body.get("settings")),
        reasoning=bool(body.get("reasoning")),
    )
    spatial_refs(message, body.get("spatial_refs"))
    if body.get("regex") is not None:
        message.regex = body["regex"]
    adapter_names.apply(ex, body, message.settings)
    priority(body, message.settings)
    await set_image(message, body.get("image_url"))
    return await _text(ex, message, "answer", bool(body.get("stream")))


async def point(ex: Exchange) -> web.StreamResponse:
    ex.names = dict(NAMES)
    body = await ex.json(POINT)
    message = pb.PointRequest(object=body["object"], settings=settings(body.get("settings")))
    spatial_refs(message, body.get("spatial_refs"))
    adapter_names.apply(ex, body, message.settings)
    priority(body, message.settings)
    await set_image(message, body["image_url"])
    call = ex.active_call
    done = await call.final(await call.build(message))
    points = [{"x": p.x, "y": p.y} for p in done.points]
    return ex.respond({"points": points, **_tail(ex, done)})


async def detect(ex: Exchange) -> web.StreamResponse:
    ex.names = dict(NAMES)
    body = await ex.json(DETECT)
    message = pb.DetectRequest(object=body["object"], settings=settings(body.get("settings")))
    spatial_refs(message, body.get("spatial_refs"))
    adapter_names.apply(ex, body, message.settings)
    priority(body, message.settings)
    await set_image(message, body["image_url"])
    call = ex.active_call
    done = await call.final(await call.build(message))
    return ex.respond({"objects": [region(b) for b in done.boxes], **_tail(ex, done)})


async def segment(ex: Exchange) -> web.StreamResponse:
    ex.names = dict(NAMES)
    body = await ex.json(SEGMENT)
    message = pb.SegmentRequest(object=body["object"], settings=settings(body.get("settings")))
    spatial_refs(message, body.get("spatial_refs"))
    adapter_names.apply(ex, body, message.settings)
    priority(body, message.settings)
    await set_image(message, body["image_url"])
    call = ex.active_call
    submitted = await call.submit(await call.build(message))
    if not body.get("stream"):
        done = await call.result(submitted)  # frees the request on any early exit
        seg = done.segmentation
        answer: dict[str, Any] = {"path": outline(seg), **_tail(ex, done)}
        if seg is not None:
            answer["bbox"] = region(seg.box)
        return ex.respond(answer)
    try:
        events = await ex.stream()
        boxed = streamed = False
        async with contextlib.aclosing(call.events(submitted)) as produced:
            async for event in produced:
                if isinstance(event, PathDelta):
                    if event.box is not None and not boxed:
                        bbox = region(event.box)
                        await events.send(
                            {"type": "bbox", "bbox": bbox, "request_id": ex.request_id}
                        )
                        boxed = True
                    if event.chunk:
                        await events.send(
                            {"type": "path_delta", "chunk": event.chunk, "completed": False}
                        )
                        streamed = True
                elif isinstance(event, Finished):
                    await _segment_end(ex, events, event, boxed, streamed)
    finally:
        submitted.cancel()  # a no-op once finished; frees the request on any early exit
    await events.close()
    return events.response


def outline(seg: Segmentation | None) -> str:
    """The path Moondream's API answers: box-relative where the model writes it so."""
    if seg is None:
        return ""
    return seg.box_path if seg.box_path is not None else seg.svg_path


async def _segment_end(
    ex: Exchange, events: EventStream, done: Finished, boxed: bool, streamed: bool
) -> None:
    """The final event, after what a model that does not stream its outline left unsent."""
    seg = done.segmentation
    path = outline(seg)
    bbox = region(seg.box) if seg is not None else None
    if bbox is not None and not boxed:
        await events.send({"type": "bbox", "bbox": bbox, "request_id": ex.request_id})
    if path and not streamed:
        await events.send({"type": "path_delta", "chunk": path, "completed": False})
    await events.send(
        {"type": "final", "path": path, "bbox": bbox, "completed": True, **_tail(ex, done)}
    )
