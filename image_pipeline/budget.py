"""A bound on decoded image bytes in flight, shared by the threads that decode.

The pixel limit caps one image; it does not cap many at once. Small, highly compressed
uploads can each expand to hundreds of megabytes, so the decoders reserve their decoded
size here first and wait while others hold the budget.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from .errors import ImageError, ImageErrorReason

__all__ = ["DecodeBudget", "reserve"]


class DecodeBudget:
    """Counts bytes reserved by decodes in progress; at most ``capacity`` at a time.

    An image whose decode alone needs more than the whole budget is refused at once
    (it could never run); others wait, first come first served, for room.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.in_flight = 0
        self.peak = 0
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the budget for the duration of the ``with`` block."""
        if nbytes > self.capacity:
            raise ImageError(
                ImageErrorReason.OVER_DECODE_BUDGET,
                f"decoding needs about {nbytes} bytes; the decode budget is "
                f"{self.capacity} bytes (image_decode_budget)",
            )
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            # In order: a big image is not starved by a stream of small ones.
            while ticket != self._serving or self.in_flight + nbytes > self.capacity:
                self._cond.wait()
            self._serving += 1
            self.in_flight += nbytes
            self.peak = max(self.peak, self.in_flight)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self.in_flight -= nbytes
                self._cond.notify_all()


def reserve(budget: DecodeBudget | None, nbytes: int) -> AbstractContextManager[None]:
    """``budget.reserve(nbytes)``, or nothing to hold without a budget."""
    return budget.reserve(nbytes) if budget is not None else nullcontext()
