"""Receiving a batch input file: streamed to disk, every line checked as it arrives.

The bytes go to a file beside the store's (never held whole in memory), a megabyte at a time
on a worker thread, which also checks each whole line with `parse_line` and refuses repeated
``custom_id``s: a bad file is refused with a 400 naming its first bad line and the member at
fault, before any of it runs. What a line's body asks of its route is checked when it runs
(an error line in the batch's error file, as the route would answer it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from aiohttp import BodyPartReader

from vlm_server.bulk.lines import LineError, parse_line
from vlm_server.engine.api import ErrorCode
from vlm_server.frontend.refusals import invalid
from vlm_server.http.error_bodies import HttpError

FILE_FIELD = "file"
_READ_BYTES = 1 << 18
_FLUSH_BYTES = 1 << 20  # handed to the worker thread at once


class LineRefusal(HttpError):
    """A bad line of an uploaded file: ``line`` its number (from 1), ``field`` its member."""

    def __init__(self, line: int, err: LineError) -> None:
        super().__init__(400, ErrorCode.INVALID_ARGUMENT, f"line {line}: {err}", err.field)
        self.line = line


def too_large(limit: int) -> HttpError:
    message = (
        f"{FILE_FIELD}: larger than the server's limit of {limit} bytes (max_batch_file_bytes)"
    )
    return HttpError(413, ErrorCode.RESOURCE_EXHAUSTED, message, FILE_FIELD)


def too_many_lines(limit: int) -> HttpError:
    message = (
        f"{FILE_FIELD}: more than the server's limit of {limit} request lines (max_batch_lines)"
    )
    return HttpError(413, ErrorCode.RESOURCE_EXHAUSTED, message, FILE_FIELD)


class InputFile:
    """An input file being written and checked, of at most ``max_lines`` request lines; its
    methods run on a worker thread."""

    def __init__(self, path: Path, max_lines: int) -> None:
        self.path = path
        self.max_lines = max_lines
        self.size = 0
        self.lines = 0  # request lines (blank lines are skipped)
        self.urls: dict[str, int] = {}  # each route the lines name: its first line
        self._number = 0
        self._seen: dict[str, int] = {}
        self._tail: list[bytes] = []  # the line not ended yet
        self._out: BinaryIO | None = path.open("xb")

    def feed(self, chunks: Sequence[bytes]) -> None:
        assert self._out is not None
        for chunk in chunks:
            self._out.write(chunk)
            self.size += len(chunk)
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                self._tail.append(chunk[start:end])
                self._check(b"".join(self._tail))
                self._tail = []
                start = end + 1
            if start < len(chunk):
                self._tail.append(chunk[start:])

    def finish(self) -> None:
        """Check the last line (which may lack its newline) and sync the file to the disk."""
        assert self._out is not None
        if self._tail:
            self._check(b"".join(self._tail))
            self._tail = []
        if not self.lines:
            raise invalid(FILE_FIELD, "has no request lines (one JSON object a line)")
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        self._out = None

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        self.path.unlink(missing_ok=True)

    def _check(self, raw: bytes) -> None:
        self._number += 1
        if not raw.strip():
            return
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise LineRefusal(self._number, LineError("line: not UTF-8 text")) from None
        try:
            request = parse_line(text)
        except LineError as err:
            raise LineRefusal(self._number, err) from None
        first = self._seen.setdefault(request.custom_id, self._number)
        if first != self._number:
            message = f"custom_id: {request.custom_id!r:.80} repeats line {first}'s"
            raise LineRefusal(self._number, LineError(message, "custom_id"))
        self.urls.setdefault(request.url, self._number)
        self.lines += 1
        if self.lines > self.max_lines:
            raise too_many_lines(self.max_lines)


async def receive(part: BodyPartReader, path: Path, limit: int, max_lines: int) -> InputFile:
    """Stream ``part`` to ``path`` (at most ``limit`` bytes), checked; removed again on any
    error."""
    received = await asyncio.to_thread(InputFile, path, max_lines)
    try:
        pending: list[bytes] = []
        size = pending_size = 0
        while chunk := await part.read_chunk(_READ_BYTES):
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            pending.append(chunk)
            pending_size += len(chunk)
            if pending_size >= _FLUSH_BYTES:
                await asyncio.to_thread(received.feed, pending)
                pending, pending_size = [], 0
        await asyncio.to_thread(received.feed, pending)
        await asyncio.to_thread(received.finish)
    except BaseException:
        await asyncio.to_thread(received.discard)
        raise
    return received


_SMALL_READ_BYTES = 1 << 12


async def small_field(part: BodyPartReader, name: str, limit: int) -> str:
    """A short text field of a form (read within ``limit`` bytes)."""
    data = b""
    # Reads shorter than the form's boundary make aiohttp push bytes back (deprecated there).
    while chunk := await part.read_chunk(max(limit + 1, _SMALL_READ_BYTES)):
        data += chunk
        if len(data) > limit:
            raise invalid(name, f"longer than {limit} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise invalid(name, "not UTF-8 text") from None
