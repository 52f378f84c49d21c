"""Python garbage-collection pauses of this process, counted by generation.

Every thread waits while a collection runs, a scheduler thread's next launch included. The
callback only bumps counters: it runs inside whichever thread allocated, possibly one that
holds a lock the reader takes, so it must take none (a racy read is fine for metrics).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

# Histogram bounds (seconds): from a young collection's 0.1 ms to a full one's 0.25 s.
GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass(frozen=True)
class GcPauseTotals:
    """Per generation (0, 1, 2): counts per `GC_BUCKETS` bucket (values <= the bound; one
    more for everything above), and the sum of the pauses in seconds."""

    counts: tuple[tuple[int, ...], ...]
    sums: tuple[float, ...]


class GcPauseCounter:
    """Counts collections while installed (`install`, `uninstall`)."""

    def __init__(self) -> None:
        n = len(GC_BUCKETS) + 1
        self._counts = [[0] * n for _ in range(3)]
        self._sums = [0.0] * 3
        self._started = 0.0

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = min(max(info.get("generation", 2), 0), 2)
        pause = time.perf_counter() - self._started
        self._counts[generation][bisect.bisect_left(GC_BUCKETS, pause)] += 1
        self._sums[generation] += pause

    def totals(self) -> GcPauseTotals:
        """What was counted so far."""
        return GcPauseTotals(tuple(tuple(c) for c in self._counts), tuple(self._sums))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused inside: a collection during a capture may destroy an
    unreachable graph or event of an earlier engine, a call CUDA refuses while a stream
    captures (the capture is then lost). Garbage made before is collected first, once: a
    full collection costs tens of milliseconds in a large process."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
