"""JSON request bodies parsed within bounds: nesting depth, number of values, and event-loop
time.

`json.loads` recurses once per nesting level (a body of a thousand brackets raised
RecursionError, a 500) and holds the GIL for the whole parse: tens to hundreds of
milliseconds on a body of tens of megabytes, during which neither door answers anything.
So, before `json.loads` runs:

* Every string of at least `BIG_STRING_BYTES` that is plain ASCII without escapes (a base64
  data URL: the only thing that makes a body large) is cut out of the body and replaced by a
  placeholder; only the rest, the *skeleton*, goes through the JSON parser, and the strings
  are put back afterwards. Finding them is done in bounded C-speed steps, and copying them
  with the GIL released (gil_free.py), on a worker thread: the event loop gets the GIL back
  between steps.
* The skeleton is bounded in size (`JsonLimits.max_skeleton_bytes`), and its structure is
  measured without parsing it: strings are projected away, then the nesting depth and the
  number of values (every ``[``, ``{``, ``,`` and ``:`` outside strings) are counted. A body
  beyond `JsonLimits.max_depth` or `JsonLimits.max_values` is refused with a 400 naming the
  body before the parser sees it.

Numbers the parser cannot represent (integers of thousands of digits, NaN) are 400s too.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlm_server.frontend import gil_free
from vlm_server.frontend.refusals import invalid

BODY = "body"
BIG_STRING_BYTES = 1 << 16  # strings this long are cut out of the skeleton when plain ASCII
OFF_LOOP_BYTES = 1 << 20  # bodies this large are parsed on a worker thread, in steps
_STEP = 1 << 20  # bytes one C-level step handles: bounds how long it holds the GIL

_STRUCTURE = b'"[]{},:'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_STRINGS = re.compile(rb'"[^"]*"')  # in the projection, a string holds structure bytes only
_DEPTH = np.zeros(256, np.int8)
_DEPTH[list(b"[{")] = 1
_DEPTH[list(b"]}")] = -1
_VALUES = np.zeros(256, np.int8)
_VALUES[list(b"[{,:")] = 1


@dataclass(frozen=True)
class JsonLimits:
    """Bounds on one JSON body beyond its size in bytes (the door's body limit)."""

    max_depth: int = 32  # nesting of arrays and objects; the API's own bodies need 5
    max_values: int = 100_000  # values (array items, members) in the body
    max_skeleton_bytes: int = 4 << 20  # the body without its big plain strings

    def __post_init__(self) -> None:
        if min(self.max_depth, self.max_values, self.max_skeleton_bytes) < 1:
            raise ValueError("JSON limits must be >= 1")


DEFAULT_LIMITS = JsonLimits()


async def parse_body(chunks: list[bytes], limits: JsonLimits = DEFAULT_LIMITS) -> Any:
    """The body made of ``chunks``, joined and parsed (`parse`): on a worker thread when large
    (joining bytes releases the GIL; parsing it does so between steps)."""
    if sum(map(len, chunks)) < OFF_LOOP_BYTES:
        return parse(b"".join(chunks), limits)
    return await asyncio.to_thread(_join_and_parse, chunks, limits)


def _join_and_parse(chunks: list[bytes], limits: JsonLimits) -> Any:
    return parse(b"".join(chunks), limits)


def parse(data: bytes | bytearray, limits: JsonLimits = DEFAULT_LIMITS) -> Any:
    """The JSON value of ``data``; INVALID_ARGUMENT naming the body for anything that is not
    JSON or is beyond ``limits``."""
    skeleton, big, tag = data, [], ""
    if len(data) >= OFF_LOOP_BYTES:
        skeleton, big, tag = _cut_big_strings(bytes(data), limits.max_values)
    if len(skeleton) > limits.max_skeleton_bytes:
        raise invalid(
            BODY,
            f"holds {len(skeleton)} bytes of JSON besides large plain-ASCII strings (pictures); "
            f"at most {limits.max_skeleton_bytes}",
        )
    _check_structure(skeleton, limits)
    try:
        value = json.loads(skeleton, parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise invalid(BODY, "is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise invalid(BODY, f"is not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:  # unreachable within max_depth; kept as a last line of defence
        raise invalid(BODY, f"is nested too deeply; at most {limits.max_depth} levels") from None
    except ValueError as err:  # e.g. an integer of thousands of digits
        raise invalid(BODY, f"is not usable JSON ({str(err)[:80]})") from None
    return _restore(value, big, tag) if big else value


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


def _check_structure(skeleton: bytes, limits: JsonLimits) -> None:
    """Depth and number of values of ``skeleton``, measured without parsing it."""
    # Escaped backslashes, then escaped quotes, go first: what is left of a backslash
    # escapes neither, so every quote left delimits a string.
    text = skeleton.replace(b"\\\\", b"").replace(b'\\"', b"")
    projected = text.translate(None, _NOT_STRUCTURE)
    outside = _STRINGS.sub(b'""', projected)
    codes = np.frombuffer(outside, np.uint8)
    if codes.size:
        depth = int(np.cumsum(_DEPTH[codes], dtype=np.int64).max())
        if depth > limits.max_depth:
            raise invalid(BODY, f"is nested {depth} levels deep; at most {limits.max_depth} levels")
    values = int(_VALUES[codes].sum(dtype=np.int64)) + 1
    if values > limits.max_values:
        raise invalid(BODY, f"holds {values} JSON values or more; at most {limits.max_values}")


# ---- big plain strings ------------------------------------------------------------------


def _backslashes_before(data: bytes, pos: int, floor: int) -> int:
    """How many backslashes directly precede ``data[pos]`` (none before ``floor``); looks
    back in doubling windows, so a long run costs a few C-level steps."""
    run, width = 0, 64
    while pos > floor:
        low = max(floor, pos - width)
        window = data[low:pos]
        kept = len(window.rstrip(b"\\"))
        run += len(window) - kept
        if kept:
            break
        pos, width = low, min(width * 2, _STEP)
    return run


def _find(data: bytes, sub: bytes, start: int, end: int | None = None) -> int:
    """``data.find(sub, start, end)`` for a one-byte ``sub``, a step at a time."""
    end = len(data) if end is None else end
    for i in range(start, end, _STEP):
        found = data.find(sub, i, min(end, i + _STEP))
        if found >= 0:
            return found
    return -1


def _string_end(data: bytes, start: int) -> int:
    """The index of the quote that ends the string opened at ``start`` (-1: none)."""
    end = _find(data, b'"', start + 1)
    while end > 0 and _backslashes_before(data, end, start + 1) % 2:
        end = _find(data, b'"', end + 1)
    return end


def _big_strings(data: bytes, max_strings: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the contents of every string of ``data`` at least `BIG_STRING_BYTES`
    long and free of backslashes, in order; looks at ``max_strings`` strings at most (what
    follows stays in the skeleton)."""
    pos = 0
    for _ in range(max_strings):
        start = _find(data, b'"', pos)
        if start < 0:
            return
        end = _string_end(data, start)
        if end < 0:
            return
        if end - start - 1 >= BIG_STRING_BYTES and _find(data, b"\\", start + 1, end) < 0:
            yield start + 1, end
        pos = end + 1


def _ascii(data: bytes, start: int, end: int) -> str | None:
    """``data[start:end]`` as text when it is all ASCII, copied with the GIL released."""
    if not gil_free.is_ascii(data, start, end):
        return None
    return gil_free.ascii_text(data, start, end)


def _cut_big_strings(data: bytes, max_strings: int) -> tuple[bytes, list[str], str]:
    """The skeleton (big plain strings replaced by placeholders), the strings, and the
    placeholders' tag (random: no client can forge one)."""
    tag = secrets.token_hex(8)
    big: list[str] = []
    pieces: list[bytes] = []
    pos = 0
    for start, end in _big_strings(data, max_strings):
        text = _ascii(data, start, end)
        if text is None:
            continue
        pieces.append(data[pos:start])
        pieces.append(f"\\u0000{tag}:{len(big)}".encode())
        big.append(text)
        pos = end
    if not big:
        return data, [], tag
    pieces.append(data[pos:])
    return b"".join(pieces), big, tag


def _restore(value: Any, big: list[str], tag: str) -> Any:
    """``value`` with every placeholder replaced by its string (keys included)."""
    prefix = f"\x00{tag}:"

    def put(item: Any) -> Any:
        if isinstance(item, str) and item.startswith(prefix):
            return big[int(item[len(prefix) :])]
        return item

    root = [value]
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                node[i] = put(item)
                if isinstance(item, dict | list):
                    stack.append(item)
        else:
            for key in list(node):
                item = node.pop(key)
                node[put(key)] = put(item)
                if isinstance(item, dict | list):
                    stack.append(item)
    return root[0]
