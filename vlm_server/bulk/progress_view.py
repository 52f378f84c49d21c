"""A batch's progress on a terminal: one line redrawn in place on a terminal, a plain line
every so often elsewhere (a log file, CI), and the summary at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from vlm_server.bulk.runner import Progress

REDRAW_S = 0.2  # a terminal's line is redrawn at most this often
ERASE_LINE = "\r\x1b[K"


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def status(p: Progress) -> str:
    """done/total, lines and output tokens a second, failures, time left."""
    elapsed = max(p.elapsed_s, 1e-9)
    done = f"{p.done}/{p.total}" if p.total is not None else str(p.done)
    share = f" ({100 * p.done // p.total}%)" if p.total else ""
    eta = p.eta_s()
    left = f", ETA {duration(eta)}" if eta is not None else ""
    return (
        f"{done} lines{share}, {p.rate():.1f} lines/s, {p.output_tokens / elapsed:.0f} tok/s, "
        f"{p.failed} failed{left}"
    )


def summary(p: Progress) -> str:
    """The closing line: what this run did."""
    elapsed = max(p.elapsed_s, 1e-9)
    return (
        f"{p.completed} completed, {p.failed} failed, {p.skipped} skipped (done before) in "
        f"{elapsed:.1f} s, {p.output_tokens / elapsed:.0f} output tok/s"
    )


class ProgressView:
    """Shows `status` on ``stream``: redrawn in place where ``tty``, else a line every
    ``every_s`` seconds. `update` is the runner's ``on_progress``."""

    def __init__(
        self,
        stream: TextIO,
        tty: bool,
        every_s: float,
        prefix: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.tty = tty
        self.every_s = REDRAW_S if tty else every_s
        self.prefix = prefix
        self._clock = clock
        self._last: float | None = None
        self._drawn = False

    def update(self, p: Progress) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        self.show(p)

    def show(self, p: Progress) -> None:
        """Draw the status now."""
        text = self.prefix + status(p)
        if self.tty:
            self.stream.write(ERASE_LINE + text)
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self, line: str) -> None:
        """Leave the status line and print ``line`` below it."""
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
        self.stream.write(self.prefix + line + "\n")
        self.stream.flush()
