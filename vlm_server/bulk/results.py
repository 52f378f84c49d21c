"""A results file that survives being killed: each result one JSON line, written whole.

`ResultLog.open` reads what an earlier run wrote: the ``custom_id`` of every whole line, and a
torn last line (the writer killed mid-write) cut off. `write` appends one line with a single
``write`` on a file opened for appending, so a line is either all there or (killed mid-way)
cut off at the next open; a ``custom_id`` already in the file is never written again. A killed
process loses nothing written (the kernel holds it); `close` syncs it to the disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ResultLog:
    """The results of one job: ``path`` (created if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        self._fd: int | None = None

    def open(self) -> set[str]:
        """Open for appending; the ``custom_id``s already written (a torn tail is dropped)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.done = _whole_lines(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return set(self.done)

    def write(self, line: dict[str, Any]) -> bool:
        """Append ``line`` unless its ``custom_id`` is written already (False then)."""
        assert self._fd is not None, "open() first"
        custom_id = line["custom_id"]
        if custom_id in self.done:
            return False
        data = (json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:  # a regular file takes it in one write; a short one goes on from there
            view = view[os.write(self._fd, view) :]
        self.done.add(custom_id)
        return True

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResultLog:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _whole_lines(fd: int, path: Path) -> set[str]:
    """The ids of the whole lines of the file open at ``fd``; a last line without its newline
    (or not JSON: cut off mid-write) is truncated away."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0) if size else b""
    keep = data.rfind(b"\n") + 1  # 0 when no line is whole
    ids: set[str] = set()
    for raw in data[:keep].splitlines():
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            # Every result line has both members; a request line (the input, given as the
            # output by mistake) has neither, and must not be appended to.
            if "response" not in line or "error" not in line:
                raise KeyError("response")
            ids.add(line["custom_id"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{path}: a line of the results file is not a result line; "
                "is it another file? (move it away, or choose another output)"
            ) from None
    if keep < size:
        os.ftruncate(fd, keep)
    return ids


def read_results(path: Path) -> list[dict[str, Any]]:
    """Every whole result line of ``path`` (for readers: tests, format converters)."""
    out = []
    for raw in path.read_bytes().split(b"\n"):
        if raw.strip():
            try:
                out.append(json.loads(raw))
            except ValueError:
                break  # a torn last line
    return out
