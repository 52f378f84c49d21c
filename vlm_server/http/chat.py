"""The OpenAI-compatible endpoints: ``POST /v1/chat/completions`` (answered by the query task)
and ``GET /v1/models``.

A chat is one query: its earlier turns (system, user and assistant messages) become the
query's context the way Moondream's author renders a conversation, the last user turn is the
question, and the conversation's one picture (a data URL in a user turn) is the picture
(chat_messages.py says exactly how).

``stop`` sequences end the answer where one first appears (never sent, not even in part: a
possible beginning is held back); the engine request is cancelled there, so such an answer has
no ``usage``. ``response_format`` (``json_object``, ``json_schema``) constrains the answer like
a regex (chat_format.py). ``reasoning: true`` (the moondream client's) or a
``reasoning_effort`` other than none / minimal asks for grounded reasoning: its text comes as
``reasoning_content`` (deltas first when streamed), stop sequences apply to the answer only.
Anything else the model cannot honour (tools, n > 1, logprobs,
penalties) is a 400 naming the field, not silently ignored. Streams are
``chat.completion.chunk`` events ending with ``data: [DONE]``; errors carry OpenAI's ``type``
and ``param`` besides the server's ``code``, ``message`` and ``field``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.engine.api import EngineError, Finished, RequestStream, TextDelta
from vlm_server.frontend.calls import Call
from vlm_server.frontend.refusals import invalid
from vlm_server.http import adapter_names, chat_messages, error_bodies
from vlm_server.http.body import Field
from vlm_server.http.chat_format import STOP_SCHEMA, response_regex, stop_sequences
from vlm_server.http.exchange import EventStream, Exchange
from vlm_server.http.moondream import PRIORITY, priority, set_image, settings
from vlm_server.http.stop_text import StopText

FINISH_REASONS = {"eos": "stop", "length": "length"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
_NO_EFFORT = ("none", "minimal")
OWNER = "moondream-serve"


def _unsupported(name: str, kind: str, what: str, ok: tuple[Any, ...] = (None,)) -> Field:
    return Field(name, kind, what, unsupported=f"{what} is not supported", unsupported_ok=ok)


CHAT = (
    Field(
        "model",
        "string",
        "A name without '/' answers with the server's model (see /v1/models); "
        "<served model>/<id>@<step> with that finetune adapter.",
    ),
    Field(
        "messages",
        "array",
        "The conversation: system (or developer) messages, then user and assistant turns, "
        "ending with a user turn (the question); one picture at most.",
        required=True,
        items=Field("message", "any", "", schema=chat_messages.MESSAGE_SCHEMA),
    ),
    Field("temperature", "number", "Sampling temperature (0 = greedy)."),
    Field("top_p", "number", "Nucleus sampling mass, in (0, 1]."),
    Field("max_tokens", "integer", "Most tokens to generate."),
    Field("max_completion_tokens", "integer", "Most tokens to generate."),
    Field("seed", "integer", "Sampling seed."),
    PRIORITY,
    Field("stream", "boolean", "Stream chat.completion.chunk events."),
    Field(
        "stream_options",
        "object",
        "Streaming options.",
        fields=(Field("include_usage", "boolean", "Send a last chunk with the usage."),),
    ),
    Field("user", "string", "An end-user id (logged nowhere)."),
    Field("stop", "any", "Up to 4 sequences that end the answer.", schema=STOP_SCHEMA),
    Field(
        "response_format",
        "any",
        "text, json_object, or json_schema with a schema (a subset of JSON Schema).",
        schema={"type": "object"},
    ),
    _unsupported("n", "integer", "more than one choice", (None, 1)),
    _unsupported("tools", "array", "tool calling", (None, [])),
    _unsupported("tool_choice", "any", "tool calling", (None, "none")),
    _unsupported("functions", "array", "function calling", (None, [])),
    _unsupported("logprobs", "boolean", "log probabilities", (None, False)),
    _unsupported("top_logprobs", "integer", "log probabilities"),
    _unsupported("logit_bias", "object", "a logit bias", (None, {})),
    _unsupported("presence_penalty", "number", "a presence penalty", (None, 0)),
    _unsupported("frequency_penalty", "number", "a frequency penalty", (None, 0)),
    Field(
        "reasoning",
        "boolean",
        "Think before answering (grounded reasoning, as the moondream client asks); the "
        "message carries it as reasoning_content.",
    ),
    Field(
        "reasoning_effort",
        "string",
        "Any effort but none or minimal turns reasoning on (the model has one effort).",
        enum=REASONING_EFFORTS,
    ),
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
                **{
                    k: {"type": "integer"}
                    for k in ("prompt_tokens", "completion_tokens", "total_tokens")
                },
                "completion_tokens_details": {
                    "type": "object",
                    "properties": {"reasoning_tokens": {"type": "integer"}},
                },
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


async def _conversation(
    ex: Exchange, messages: list[Any], message: pb.QueryRequest
) -> tuple[tuple[str, str], ...]:
    """Fill ``message`` from the chat's messages; the earlier turns, for the engine request.
    Teaches errors the JSON paths."""
    chat = chat_messages.read(messages)
    limit = ex.active_call.core.limits.max_question_chars
    if limit and chat.chars > limit:
        raise invalid(
            "messages",
            f"the conversation holds {chat.chars} characters of text; at most {limit} "
            "(--max-question-chars)",
        )
    ex.names["question"] = chat.question_field
    message.question = chat.question
    if chat.picture is not None:
        for name in ("image_bytes", "image", "image_id"):
            ex.names[name] = chat.picture.field
        await set_image(message, chat.picture.url, chat.picture.field)
    return chat.history


def _reasons(body: dict[str, Any]) -> bool:
    """Whether the request asks for reasoning (``reasoning`` or ``reasoning_effort``)."""
    effort = body.get("reasoning_effort")
    asked = body.get("reasoning")
    if asked is not None and effort is not None and bool(asked) != (effort not in _NO_EFFORT):
        raise invalid("reasoning_effort", "contradicts reasoning; send one of them")
    return bool(asked) or (effort is not None and effort not in _NO_EFFORT)


async def completions(ex: Exchange) -> web.StreamResponse:
    ex.error_style = error_style
    ex.names = {
        "settings.temperature": "temperature",
        "settings.top_p": "top_p",
        "settings.max_tokens": "max_tokens",
        "settings.seed": "seed",
        "settings.priority": "priority",
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
        ),
        reasoning=_reasons(body),
    )
    adapter_names.apply(ex, body, message.settings)  # model: "<base>/<id>@<step>"
    priority(body, message.settings)
    history = await _conversation(ex, body["messages"], message)
    call = ex.active_call
    info = call.engine().info
    stops = stop_sequences(body.get("stop"))
    pattern = response_regex(body.get("response_format"), info.max_regex_chars)
    if pattern is not None:
        message.regex = pattern
        ex.names["regex"] = "response_format"
    request = await call.build(message)
    if history:
        request = dataclasses.replace(request, history=history)
    submitted = await call.submit(request)
    head = {
        "id": f"chatcmpl-{ex.request_id}",
        "created": int(time.time()),
        "model": info.model_name,
    }
    if not body.get("stream"):
        parts: list[str] = []
        thought: list[str] = []
        end = _End(None)
        try:
            async for text, last, reasoning in _answer(call, submitted, stops):
                (thought if reasoning else parts).append(text)
                end = last or end
        finally:
            submitted.cancel()
        reply = {"role": "assistant", "content": "".join(parts)}
        if message.reasoning:
            reply["reasoning_content"] = "".join(thought)
        choice = {
            "index": 0,
            "message": reply,
            "finish_reason": _reason(end),
            "logprobs": None,
        }
        answer = {**head, "object": "chat.completion", "choices": [choice]}
        if end.finished is not None:  # a stop sequence's answer has no counts: see above
            answer["usage"] = _usage(end.finished)
        return ex.respond(answer)
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    try:
        events = await ex.stream()
        await _stream(
            events, {**head, "object": "chat.completion.chunk"}, call, submitted, stops, usage
        )
    finally:
        submitted.cancel()
    await events.send("[DONE]")
    await events.close()
    return events.response


class _End:
    """How an answer ended: the engine's `Finished`, or None when a stop sequence did."""

    def __init__(self, finished: Finished | None) -> None:
        self.finished = finished


async def _answer(
    call: Call, submitted: RequestStream, stops: tuple[str, ...]
) -> AsyncIterator[tuple[str, _End | None, bool]]:
    """(text to send, None, is reasoning) while the answer runs; its last item carries how
    it ended (after a stop sequence the caller cancels the engine request, which is then
    still running). Stop sequences apply to the answer, not to the reasoning."""
    stop = StopText(stops)
    async with contextlib.aclosing(call.events(submitted)) as produced:
        async for event in produced:
            if isinstance(event, TextDelta):
                if event.reasoning:
                    yield event.text, None, True
                    continue
                text = stop.feed(event.text)
                if stop.stopped:
                    call.finish_reason = "stop"
                    yield text, _End(None), False
                    return
                if text:
                    yield text, None, False
            elif isinstance(event, Finished):
                yield stop.flush(), _End(event), False
                return


def _reason(end: _End) -> str:
    done = end.finished
    return "stop" if done is None else FINISH_REASONS.get(done.finish_reason, done.finish_reason)


async def _stream(
    events: EventStream,
    chunk: dict[str, Any],
    call: Call,
    submitted: RequestStream,
    stops: tuple[str, ...],
    usage: bool,
) -> None:
    def choice(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}

    await events.send({**chunk, "choices": [choice({"role": "assistant", "content": ""})]})
    async for text, end, reasoning in _answer(call, submitted, stops):
        if text:
            key = "reasoning_content" if reasoning else "content"
            await events.send({**chunk, "choices": [choice({key: text})]})
        if end is not None:
            await events.send({**chunk, "choices": [choice({}, _reason(end))]})
            if usage and end.finished is not None:
                await events.send({**chunk, "choices": [], "usage": _usage(end.finished)})


def _usage(done: Finished) -> dict[str, Any]:
    """OpenAI's usage: completion tokens count reasoning and answer, the reasoning's apart."""
    m = done.metrics
    total = m.input_tokens + m.output_tokens
    return {
        "prompt_tokens": m.input_tokens,
        "completion_tokens": m.output_tokens,
        "total_tokens": total,
        "completion_tokens_details": {"reasoning_tokens": m.reasoning_tokens},
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
    # Resident finetune adapters, by the model names that select them.
    adapters = [
        {**entry, "id": f"{info.model_name}/{name}", "parent": info.model_name, "rank": rank}
        for name, rank in call.engine().stats().adapters
    ]
    return ex.respond({"object": "list", "data": [entry, *adapters]})
