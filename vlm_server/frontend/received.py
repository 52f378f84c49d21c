"""A request's picture bytes kept beside its proto message instead of inside it.

Protobuf messages (upb) copy a ``bytes`` field in whole on every write and every read (and
measuring a message serializes it), each one C call holding the GIL for the whole picture, on
whichever thread touches the field: for a request's handler, the event loop. So a door that has
a request's picture as bytes already (HTTP's decoded data URL, the picture cut out of a gRPC
message) does not put them into the message: it *attaches* them to it, for the rest of the
request's task, and the image resolver takes them from there.

The attachment lives in a context variable: the request's own task (and any task it starts
afterwards) sees it, no other request does, and it goes with the task.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

OFF_LOOP_BYTES = 1 << 20  # bodies this large are handled on a worker thread


@dataclass(frozen=True)
class _Attached:
    message: Any
    field: str
    data: bytes


_ATTACHED: contextvars.ContextVar[_Attached | None] = contextvars.ContextVar(
    "attached_request_bytes", default=None
)


def attach(message: Any, field: str, data: bytes) -> None:
    """``data`` is ``message``'s ``field`` (a member of its ``image`` oneof) for the rest of
    the current task, though the message itself does not hold it."""
    _ATTACHED.set(_Attached(message, field, data))


def attached(message: Any, field: str = "image_bytes") -> bytes | None:
    """The bytes attached to ``message`` as ``field`` in this task; None when there are none."""
    held = _ATTACHED.get()
    if held is None or held.message is not message or held.field != field:
        return None
    return held.data


def image_field(message: Any) -> str | None:
    """Which member of the ``image`` oneof ``message`` sets, attached bytes included."""
    held = _ATTACHED.get()
    if held is not None and held.message is message:
        return held.field
    which: str | None = message.WhichOneof("image")
    return which


def image_bytes(message: Any) -> bytes:
    """``message.image_bytes``, attached or in the message."""
    data = attached(message)
    return data if data is not None else message.image_bytes
