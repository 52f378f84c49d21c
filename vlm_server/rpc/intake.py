"""What happens to a call before its handler runs.

1. Requests that are not valid protobuf, or declare a string field far beyond its limit
   (field_limits.py: refused before it is copied), answer INVALID_ARGUMENT naming the field,
   without a traceback. grpc.aio parses a request before the handler runs; a parse error
   (corrupt wire format, or invalid UTF-8 in a ``string`` field) would escape as UNKNOWN
   with the exception's class in the message and an error-level traceback per request. The
   interceptor wraps every method's parser so a failure becomes a `Malformed` value, which
   the wrapped handler answers. `bad_utf8_field` walks the wire format to name the field.
2. Calls that end before their request message is read are still counted, with the code the
   clock gives them. When a deadline passes while the request is still arriving (a large image
   under load), gRPC would end the call without ever running a unary handler, and could not
   say whether the deadline or the client ended it; so every unary method is served as a
   request-streaming one (the same on the wire), whose handler runs at once, notes the
   deadline, then reads the one message.
3. A message over a megabyte is parsed on a worker thread, its picture cut out of the wire
   bytes first and copied with the GIL released (big_fields.py), then attached beside the
   message (frontend/received.py): the event loop never parses or copies it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from vlm_server.frontend import gil_free, received
from vlm_server.frontend.calls import deadline_passed, request_id
from vlm_server.rpc.auth import RejectHook
from vlm_server.rpc.big_fields import FIELD, cut_bytes_field
from vlm_server.rpc.field_limits import oversized_field, read_varint
from vlm_server.rpc.status import FIELD_METADATA_KEY, REQUEST_ID_METADATA_KEY

# (method, status code, client's request id) of a call that ended before its request was read.
UnstartedHook = Callable[[str, str, str | None], None]

_MAX_DEPTH = 32  # deeper nesting than any of our messages has: stop looking


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse; ``field`` is its proto path when known."""

    type_name: str
    reason: str
    field: str | None = None
    text: str = ""  # the whole message, when not the parser's

    @property
    def message(self) -> str:
        if self.text:
            return self.text
        where = f"{self.field}: " if self.field else ""
        return f"{where}not a valid {self.type_name} message ({self.reason})"


def bad_utf8_field(data: bytes, descriptor: Descriptor, depth: int = 0) -> str | None:
    """The path (``settings.x``, ``choices``) of the first string field in ``data`` whose
    bytes are not UTF-8; None when there is none or the wire format breaks first."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = read_varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = read_varint(data, pos)
                continue
            if wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                continue
            if wire_type != 2:
                return None  # groups or garbage: nothing of ours
            length, pos = read_varint(data, pos)
            chunk, pos = data[pos : pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return field.name
            elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
                inner = bad_utf8_field(chunk, field.message_type, depth + 1)
                if inner is not None:
                    return f"{field.name}.{inner}"
    except ValueError:
        return None
    return None


def _message_class(parse: Callable[[bytes], Any]) -> type[Message] | None:
    owner = getattr(parse, "__self__", None)  # FromString is a classmethod of the type
    return owner if isinstance(owner, type) and issubclass(owner, Message) else None


def guarded_parser(
    parse: Callable[[bytes], Any], field_limits: Mapping[str, int] | None = None
) -> Callable[[bytes], Any]:
    """``parse``, returning a `Malformed` instead of raising on bad input, or on a string field
    declared longer than ``field_limits`` allow (refused before it is copied)."""
    cls = _message_class(parse)
    type_name = cls.DESCRIPTOR.full_name if cls is not None else "request"

    def guarded(data: bytes) -> Any:
        if field_limits and cls is not None:
            big = oversized_field(data, cls.DESCRIPTOR, field_limits)
            if big is not None:
                return Malformed(type_name, "", big.field, big.message)
        try:
            return parse(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as err:
            reason = str(err).rsplit(": ", 1)[-1] or type(err).__name__
            field = bad_utf8_field(data, cls.DESCRIPTOR) if cls is not None else None
            if field is not None:
                reason = "invalid UTF-8 in a string field"
            return Malformed(type_name, reason, field)

    return guarded


def parse_large(
    parser: Callable[[bytes], Any], cls: type[Message] | None, data: bytes
) -> tuple[Any, bytes | None]:
    """A large ``cls`` message parsed by ``parser`` (a `guarded_parser`), on a worker thread:
    the message, and its `FIELD` when it sets one, copied out with the GIL released. The
    loop never runs this."""
    cut = None if cls is None else cut_bytes_field(data, cls.DESCRIPTOR, received.OFF_LOOP_BYTES)
    if cut is None:
        request = parser(data)
        if (
            cls is None
            or isinstance(request, Malformed)
            or FIELD not in cls.DESCRIPTOR.fields_by_name
        ):
            return request, None
        # A shape the cut leaves alone (rare): the message holds the field; read it here.
        return request, getattr(request, FIELD) if _sets(request) else None
    request = parser(cut.rest)
    if isinstance(request, Malformed):
        return request, None
    return request, gil_free.bytes_of(data, cut.start, cut.end)


def _sets(request: Any) -> bool:
    field = request.DESCRIPTOR.fields_by_name[FIELD]
    if field.containing_oneof is not None:
        return bool(request.WhichOneof(field.containing_oneof.name) == FIELD)
    return True


def _client_request_id(context: grpc.aio.ServicerContext) -> str | None:
    sent = next((v for k, v in context.invocation_metadata() or () if k == "x-request-id"), None)
    return sent if isinstance(sent, str) else None


async def _abort(bad: Malformed, context: grpc.aio.ServicerContext) -> None:
    # A request id like every other answer's: the client's when it sent a valid one.
    rid = request_id(_client_request_id(context))
    trailing: tuple[tuple[str, str], ...] = ((REQUEST_ID_METADATA_KEY, rid),)
    if bad.field:
        trailing += ((FIELD_METADATA_KEY, bad.field),)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message, trailing_metadata=trailing)


async def _read_one(
    context: grpc.aio.ServicerContext, method: str, hook: UnstartedHook | None, started: list[bool]
) -> Any:
    """The call's one request message, read by its handler: a call whose deadline passes
    while its message is still arriving is then reported as what it is (the clock tells a
    deadline from a client's cancel; gRPC tells neither to a handler not yet running)."""
    # Read now: after a cancel the call's core object may be gone.
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    rid = _client_request_id(context)

    def ended() -> asyncio.CancelledError:
        started[0] = True  # reported here
        if hook is not None:
            expired = deadline_passed(deadline, remaining)
            hook(method, "DEADLINE_EXCEEDED" if expired else "CANCELLED", rid)
        return asyncio.CancelledError()  # over: gRPC ends a cancelled handler quietly

    try:
        request = await context.read()  # EOF, not an error, once the call has ended
        if request is grpc.aio.EOF:
            # Ended, or a client that closed its side without a message: the abort then
            # tells them apart (it fails on an ended call).
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
    except grpc.aio.AbortError:
        started[0] = True
        raise
    except (asyncio.CancelledError, Exception) as err:
        raise ended() from err
    started[0] = True
    return request


def _guarded_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    on_reject: RejectHook | None,
    started: list[bool],
    field_limits: Mapping[str, int] | None = None,
    on_unstarted: UnstartedHook | None = None,
    executor: Executor | None = None,
) -> grpc.RpcMethodHandler:
    """``handler`` served as a request-streaming one (the same on the wire), so that it runs
    before its message arrives: see `_read_one`."""

    async def read(context: grpc.aio.ServicerContext) -> Any:
        data = await _read_one(context, method, on_unstarted, started)
        if len(data) <= received.OFF_LOOP_BYTES:
            request = parser(data)
        else:
            loop = asyncio.get_running_loop()
            request, image = await loop.run_in_executor(executor, parse_large, parser, cls, data)
            if image is not None:
                received.attach(request, FIELD, image)
        if isinstance(request, Malformed):
            if on_reject is not None:
                on_reject(method, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            await _abort(request, context)
        return request

    parser = guarded_parser(handler.request_deserializer, field_limits)
    cls = _message_class(handler.request_deserializer)
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner_uu(await read(context), context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary,
            request_deserializer=None,  # raw bytes: `read` parses them
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def stream_stream(
            requests: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            messages = inner_us(await read(context), context)
            if inspect.isawaitable(messages):  # a handler that writes with context.write
                await messages
                return
            async with contextlib.aclosing(messages):
                async for message in messages:
                    yield message

        return grpc.stream_stream_rpc_method_handler(
            stream_stream,
            request_deserializer=None,  # raw bytes: `read` parses them
            response_serializer=handler.response_serializer,
        )
    started[0] = True  # client streaming (reflection): parsed per message by its own handler
    return handler


class IntakeInterceptor(grpc.aio.ServerInterceptor):
    """Answers unparsable unary requests with INVALID_ARGUMENT instead of UNKNOWN, and
    reports calls to ``watched`` services that end before their handler starts.

    Put it first in the chain: it must wrap the handler that finally runs (an auth
    refusal included), or a refused call would look unstarted."""

    def __init__(
        self,
        on_reject: RejectHook | None = None,
        on_unstarted: UnstartedHook | None = None,
        watched: tuple[str, ...] = (),
        field_limits: Mapping[str, int] | None = None,
        executor: Executor | None = None,
    ) -> None:
        """``executor``: where large messages are parsed (None: the loop's default)."""
        self._executor = executor
        self._field_limits = field_limits
        self._on_reject = on_reject
        self._on_unstarted = on_unstarted
        self._watched = tuple(f"/{name}/" for name in watched)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        started = [False]
        hook = None
        if self._on_unstarted is not None and details.method.startswith(self._watched):
            hook, method = self._on_unstarted, details.method
            # This runs in the call's own task, which ends however the call ends: a call
            # ended before its handler even ran has no clock to read (CANCELLED).
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(
                    lambda _: None if started[0] else hook(method, "CANCELLED", None)  # type: ignore[misc]
                )
        return _guarded_handler(
            handler,
            details.method,
            self._on_reject,
            started,
            self._field_limits,
            hook,
            self._executor,
        )
