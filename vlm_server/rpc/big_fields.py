"""A request's picture cut out of its serialized bytes before the message is parsed.

Parsing a message copies its ``image_bytes`` into the message in one C call, and every read of
the field copies it out again in another, each holding the GIL for the whole picture. The wire
format declares every field's length up front, so a walk over the top-level fields finds the
picture without touching it: the rest of the message (a few hundred bytes) is parsed, and the
picture is copied out of the received bytes with the GIL released (`gil_free.bytes_of`), then
attached to the message (`received.attach`) instead of set in it.

The picture is cut only where that changes nothing the parser would decide: it occurs once,
and no other member of its oneof occurs (protobuf keeps the last one). Anything else is parsed
whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from vlm_server.rpc.field_limits import wire_fields

FIELD = "image_bytes"


@dataclass(frozen=True)
class Cut:
    """``data`` without the field (``rest``), and where the field's contents lie in it."""

    rest: bytes
    start: int
    end: int


def _fields(data: bytes) -> list[tuple[int, int, int, int]] | None:
    """(number, key's start, contents' start, end) of each top-level field; None when the wire
    format breaks, is cut short or has more than `MAX_FIELDS` fields."""
    try:
        out = list(wire_fields(data))
    except ValueError:
        return None
    return out if not out or out[-1][3] <= len(data) else None


def cut_bytes_field(data: bytes, descriptor: Descriptor, min_bytes: int) -> Cut | None:
    """``data`` (a serialized ``descriptor`` message) with its `FIELD` cut out, when that field
    is at least ``min_bytes`` long and cutting it changes nothing; None otherwise."""
    field = descriptor.fields_by_name.get(FIELD)
    if field is None or field.type != FieldDescriptor.TYPE_BYTES:
        return None
    fields = _fields(data)
    if fields is None:
        return None
    rivals = {field.number}
    if field.containing_oneof is not None:
        rivals |= {f.number for f in field.containing_oneof.fields}
    found = [f for f in fields if f[0] in rivals]
    if len(found) != 1 or found[0][0] != field.number:
        return None
    _, key_start, start, end = found[0]
    if end - start < min_bytes:
        return None
    return Cut(data[:key_start] + data[end:], start, end)
