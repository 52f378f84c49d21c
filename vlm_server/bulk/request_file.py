"""A file of OpenAI batch request lines as a batch.

`scan` reads the whole file first, as OpenAI validates a batch's file before it runs: every
line must carry a usable ``custom_id`` and no two the same (refused naming both line
numbers); a line that is otherwise wrong (an unknown url, no body) runs as an error line.
It keeps each line's place, so that the run reads (with ``pread``) and parses each line on a
thread, and a line an earlier run wrote is skipped without being read again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vlm_server.bulk import lines
from vlm_server.bulk.lines import LineError, parse_line
from vlm_server.bulk.read_ahead import LineSource
from vlm_server.bulk.runner import Item


class RequestFileError(ValueError):
    """A requests file that cannot run at all; the message names the line(s)."""


@dataclass(frozen=True)
class RequestLine:
    """Where one line lies in the file (``number`` from 1, as editors count)."""

    number: int
    custom_id: str
    offset: int
    length: int


def scan(path: Path) -> list[RequestLine]:
    """Every non-blank line of ``path`` with its ``custom_id``; `RequestFileError` for a line
    without a usable one, or one already used by an earlier line."""
    seen: dict[str, int] = {}
    found: list[RequestLine] = []
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            custom_id = lines.custom_id_of(raw.decode("utf-8", "replace"))
            if custom_id is None:
                raise RequestFileError(f"{path} line {number}: {_why(raw)}")
            if custom_id in seen:
                raise RequestFileError(
                    f"{path}: custom_id {custom_id!r:.80} is on line {seen[custom_id]} and "
                    f"line {number}; each line's custom_id must be unique"
                )
            seen[custom_id] = number
            found.append(RequestLine(number, custom_id, start, len(raw)))
    return found


def _why(raw: bytes) -> str:
    try:
        parse_line(raw.decode("utf-8", "replace"))
    except LineError as err:
        return str(err)
    return "custom_id: required, a non-empty string"  # parse_line names it in every case


class RequestSource(LineSource[RequestLine]):
    """The lines of a scanned requests file."""

    def __init__(self, path: Path, found: list[RequestLine]) -> None:
        self.path = path
        self.lines = found
        self._fd = os.open(path, os.O_RDONLY)

    def make(self, line: RequestLine) -> Item:
        """The checked request of one line, or why it cannot run (runs on a thread)."""
        raw = os.pread(self._fd, line.length, line.offset)
        try:
            request = parse_line(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return line.custom_id, LineError(f"line {line.number}: not UTF-8 text")
        except LineError as err:
            return line.custom_id, err
        if request.custom_id != line.custom_id:  # the file was rewritten since the scan
            return line.custom_id, LineError(
                f"line {line.number}: the file changed while the batch ran", "custom_id"
            )
        return request

    def close(self) -> None:
        os.close(self._fd)
