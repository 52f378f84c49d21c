"""Oversized string fields refused from their declared length, before the message is parsed.

gRPC hands the server a request's serialized bytes; parsing a 10 MB ``question`` copies and
UTF-8-checks all of it on the event loop before any check could refuse it. The wire format
declares every field's length up front, so a walk over the top-level fields (skipping each by
its length) finds a string field too long for its character limit without touching its
contents: UTF-8 takes at most 4 bytes a character, so more than 4 x limit bytes is surely
beyond it. Anything else (shorter, or a malformed wire format) is left to the parser and the
shared validation, which give the exact message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor

MAX_FIELDS = 4096  # top-level fields walked at most (a repeated field counts each element)
_UTF8_MAX = 4


@dataclass(frozen=True)
class Oversized:
    field: str
    nbytes: int
    limit: int  # characters

    @property
    def message(self) -> str:
        return f"{self.field}: is {self.nbytes} bytes long; at most {self.limit} characters"


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at ``pos``: (value, the position after it); ValueError if cut."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def wire_fields(data: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(number, key's start, contents' start, end) of each top-level field of ``data``, skipped
    by its declared length (``end`` may lie past ``data`` when it is cut short); ValueError when
    the wire format breaks or holds more than `MAX_FIELDS` fields."""
    pos = 0
    for _ in range(MAX_FIELDS):
        if pos >= len(data):
            return
        key_start = pos
        key, pos = read_varint(data, pos)
        wire_type = key & 7
        start = pos
        if wire_type == 0:
            _, pos = read_varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, start = read_varint(data, pos)
            pos = start + length
        else:
            raise ValueError("a group or garbage")
        yield key >> 3, key_start, start, pos
    if pos < len(data):
        raise ValueError(f"more than {MAX_FIELDS} top-level fields")


def oversized_field(
    data: bytes, descriptor: Descriptor, limits: Mapping[str, int]
) -> Oversized | None:
    """The first top-level string field of ``data`` (a serialized ``descriptor`` message)
    whose declared length is beyond ``limits[name]`` characters; None when there is none (or
    the wire format breaks: the parser's to refuse)."""
    numbers = {
        f.number: (f.name, limits[f.name])
        for f in descriptor.fields
        if f.name in limits and f.type == FieldDescriptor.TYPE_STRING
    }
    if not numbers:
        return None
    try:
        for number, _, start, end in wire_fields(data):
            known = numbers.get(number)
            if known is not None and end - start > _UTF8_MAX * known[1]:
                return Oversized(known[0], end - start, known[1])
    except ValueError:
        return None
    return None
