"""The OpenAI-compatible endpoints: ``POST /v1/chat/completions`` (answered by the query task)
and ``GET /v1/models``.

The model answers one question about at most one picture, so a chat is exactly one user
message: text parts (the question) and at most one ``image_url`` part holding a data URL.
Anything the model cannot honour (system or earlier turns, tools, stop sequences, n > 1) is
refused with a 400 naming the field rather than ignored. Streams are ``chat.completion.chunk``
events ending with ``data: [DONE]``; errors carry OpenAI's ``type`` and ``param`` besides the
server's ``code``, ``message`` and ``field``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from aiohttp import web

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.api import EngineError, Finished, TextDelta
from vlm_server.frontend.refusals import invalid
from vlm_server.http import error_bodies
from vlm_server.http.body import Field, check
from vlm_server.http.exchange import Exchange
from vlm_server.http.moondream import set_image, settings

FINISH_REASONS = {"eos": "stop", "length": "length"}
OWNER = "moondream-serve"

_MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["user"]},
        "content": {
            "description": "The question, or content parts: text and at most one image_url "
            "(a base64 data URL).",
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"type": "string", "enum": ["text", "image_url"]},
                            "text": {"type": "string"},
                            "image_url": {
                                "type": "object",
                                "properties": {
                                    "url": {"type": "string"},
                                    "detail": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            ],
        },
        "name": {"type": "string"},
    },
}


def _unsupported(name: str, kind: str, what: str, ok: tuple[Any, ...] = (None,)) -> Field:
    return Field(name, kind, what, unsupported=f"{what} is not supported", unsupported_ok=ok)


CHAT = (
    Field("model", "string", "Any name: the server's one model answers (see /v1/models)."),
    Field(
        "messages",
        "array",
        "Exactly one user message.",
        required=True,
        items=Field("message", "any", "", schema=_MESSAGE_SCHEMA),
    ),
    Field("temperature", "number", "Sampling temperature (0 = greedy)."),
    Field("top_p", "number", "Nucleus sampling mass, in (0, 1]."),
    Field("max_tokens", "integer", "Most tokens to generate."),
    Field("max_completion_tokens", "integer", "Most tokens to generate."),
    Field("seed", "integer", "Sampling seed."),
    Field("stream", "boolean", "Stream chat.completion.chunk events."),
    Field(
        "stream_options",
        "object",
        "Streaming options.",
        fields=(Field("include_usage", "boolean", "Send a last chunk with the usage."),),
    ),
    Field("user", "string", "An end-user id (logged nowhere)."),
    _unsupported("n", "integer", "more than one choice", (None, 1)),
    _unsupported("stop", "any", "stop sequences"),
    _unsupported("tools", "array", "tool calling", (None, [])),
    _unsupported("tool_choice", "any", "tool calling", (None, "none")),
    _unsupported("functions", "array", "function calling", (None, [])),
    _unsupported("response_format", "object", "a response format", (None, {"type": "text"})),
    _unsupported("logprobs", "boolean", "log probabilities", (None, False)),
    _unsupported("top_logprobs", "integer", "log probabilities"),
    _unsupported("logit_bias", "object", "a logit bias", (None, {})),
    _unsupported("presence_penalty", "number", "a presence penalty", (None, 0)),
    _unsupported("frequency_penalty", "number", "a frequency penalty", (None, 0)),
    _unsupported("reasoning_effort", "string", "reasoning"),
    _unsupported("reasoning", "any", "reasoning", (None, False)),
)

_PART = (
    Field("type", "string", "", required=True, enum=("text", "image_url")),
    Field("text", "string", ""),
    Field(
        "image_url",
        "object",
        "",
        fields=(Field("url", "string", "", required=True), Field("detail", "string", "")),
    ),
)
_MESSAGE = (
    Field("role", "string", "", required=True),
    Field("content", "any", "", required=True),
    Field("name", "string", ""),
)

CHAT_RESPONSE: dict[str, Any] = {
    "type": "object",
    "description": "A chat.completion (or, streamed, chat.completion.chunk events, then [DONE]).",
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {
            "type": "object",
            "properties": {
                k: {"type": "integer"}
                for k in ("prompt_tokens", "completion_tokens", "total_tokens")
            },
        },
    },
}
MODELS_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "object": {"type": "string"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "object": {"type": "string"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                    "max_model_len": {"type": "integer"},
                    "limits": {
                        "type": "object",
                        "additionalProperties": {"type": "integer"},
                        "description": "Every limit a client can hit (GetModelInfo's "
                        "ServerLimits, and max_http_body_bytes)",
                    },
                },
            },
        },
    },
}


def error_style(err: EngineError) -> dict[str, Any]:
    """The server's error object plus OpenAI's ``type`` and ``param``."""
    kind = "invalid_request_error" if error_bodies.status_of(err) < 500 else "server_error"
    out = error_bodies.body(err, {"type": kind})
    out["error"]["param"] = out["error"]["field"]
    return out


async def _question(ex: Exchange, messages: list[Any], message: pb.QueryRequest) -> None:
    """Fill ``message`` from the chat's one user message; teach errors the JSON paths."""
    if len(messages) != 1:
        raise invalid(
            "messages",
            f"this model answers one question about at most one picture: send exactly one "
            f"user message (no system or earlier turns), got {len(messages)} messages",
        )
    msg = check(_MESSAGE, messages[0], "messages[0]")
    if msg["role"] != "user":
        raise invalid("messages[0].role", f"must be user, got {str(msg['role'])[:20]!r}")
    content = msg["content"]
    ex.names["question"] = "messages[0].content"
    if isinstance(content, str):
        message.question = content
        return
    if not isinstance(content, list):
        raise invalid("messages[0].content", "must be a string or an array of content parts")
    texts: list[str] = []
    image: str | None = None
    for i, raw in enumerate(content):
        where = f"messages[0].content[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("text", "image_url"):  # the part's kind first: it decides the rest
            raise invalid(f"{where}.type", f"must be text or image_url, got {str(kind)[:40]!r}")
        part = check(_PART, raw, where)
        if part["type"] == "text":
            if part.get("text") is None:
                raise invalid(f"{where}.text", "is required in a text part")
            texts.append(part["text"])
        else:
            if part.get("image_url") is None:
                raise invalid(f"{where}.image_url", "is required in an image_url part")
            if image is not None:
                raise invalid(f"{where}", "this model takes at most one picture per question")
            image = f"{where}.image_url.url"
            for name in ("image_bytes", "image", "image_id"):
                ex.names[name] = image
            await set_image(message, part["image_url"]["url"], image)
    message.question = "\n".join(texts)


async def completions(ex: Exchange) -> web.StreamResponse:
    ex.error_style = error_style
    ex.names = {
        "settings.temperature": "temperature",
        "settings.top_p": "top_p",
        "settings.max_tokens": "max_tokens",
        "settings.seed": "seed",
    }
    body = await ex.json(CHAT)
    limit = body.get("max_tokens")
    if body.get("max_completion_tokens") is not None:
        if limit is not None and limit != body["max_completion_tokens"]:
            raise invalid("max_completion_tokens", "differs from max_tokens; send one of them")
        limit = body["max_completion_tokens"]
        ex.names["settings.max_tokens"] = "max_completion_tokens"
    message = pb.QueryRequest(
        settings=settings(
            {
                "temperature": body.get("temperature"),
                "top_p": body.get("top_p"),
                "max_tokens": limit,
                "seed": body.get("seed"),
            }
        )
    )
    await _question(ex, body["messages"], message)
    call = ex.active_call
    model = call.engine().info.model_name
    submitted = await call.submit(await call.build(message))
    head = {"id": f"chatcmpl-{ex.request_id}", "created": int(time.time()), "model": model}
    if not body.get("stream"):
        done = await call.result(submitted)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": done.text or ""},
            "finish_reason": FINISH_REASONS.get(done.finish_reason, done.finish_reason),
            "logprobs": None,
        }
        return ex.respond(
            {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(done)}
        )
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    try:
        events = await ex.stream()
        chunk = {**head, "object": "chat.completion.chunk"}

        def choice(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
            return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}

        await events.send({**chunk, "choices": [choice({"role": "assistant", "content": ""})]})
        async with contextlib.aclosing(call.events(submitted)) as produced:
            async for event in produced:
                if isinstance(event, TextDelta):
                    await events.send({**chunk, "choices": [choice({"content": event.text})]})
                elif isinstance(event, Finished):
                    reason = FINISH_REASONS.get(event.finish_reason, event.finish_reason)
                    await events.send({**chunk, "choices": [choice({}, reason)]})
                    if usage:
                        await events.send({**chunk, "choices": [], "usage": _usage(event)})
    finally:
        submitted.cancel()
    await events.send("[DONE]")
    await events.close()
    return events.response


def _usage(done: Finished) -> dict[str, int]:
    m = done.metrics
    total = m.input_tokens + m.output_tokens
    return {
        "prompt_tokens": m.input_tokens,
        "completion_tokens": m.output_tokens,
        "total_tokens": total,
    }


async def models(ex: Exchange) -> web.StreamResponse:
    call = ex.active_call
    info = call.engine().info
    entry = {
        "id": info.model_name,
        "object": "model",
        "created": 0,
        "owned_by": OWNER,
        "max_model_len": info.max_context,  # prompt + output tokens, as other servers name it
        # What a client can hit here: the gRPC API's ServerLimits, and this door's body cap.
        "limits": {**call.core.limits.describe(info), "max_http_body_bytes": ex.max_body_bytes},
    }
    return ex.respond({"object": "list", "data": [entry]})
