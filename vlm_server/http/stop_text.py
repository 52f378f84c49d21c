"""Stop sequences over streamed text: what may be sent now, and where the answer ends.

Text arrives in pieces that may split a stop sequence anywhere (``"Hel"`` + ``"lo"``), so the
end of what came so far that could still begin a stop sequence is held back until the next
piece settles it. A stop sequence itself is never sent, nor anything after it. The answer ends
at the stop sequence whose last character comes first, as if the text were checked one
character at a time: how the pieces split it never changes the answer.
"""

from __future__ import annotations


class StopText:
    """Feed pieces of text; get back what is safe to send, and whether a stop matched."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can be sent now; after a match, `stopped` is set and later pieces
        give nothing."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buffer = self._held + text
        # The match that ends first wins (then the longest): that is where generation would
        # have stopped had every token been checked, however the pieces split the text.
        found = [(i + len(s), i) for s in self.stops if (i := buffer.find(s)) >= 0]
        if found:
            self.stopped = True
            self._held = ""
            return buffer[: min(found)[1]]
        keep = self._partial(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """What was held back, once the text has ended without a match."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that begins some stop sequence."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
