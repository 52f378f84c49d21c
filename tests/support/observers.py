"""Engine observers for tests: forward each pipeline action or final event to a callback."""

from __future__ import annotations

from collections.abc import Callable

from vlm_server.engine.api import EngineError, Finished
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.pipeline import Step
from vlm_server.engine.core.sequence import Sequence


class StepLog(Observer):
    """Calls ``on_step(what, step)`` with what = launch / finalize / commit, in pipeline order,
    on the scheduler thread; ``on_end(seq, event)`` when a request gets its final event."""

    def __init__(
        self,
        on_step: Callable[[str, Step], None],
        on_end: Callable[[Sequence, Finished | EngineError], None] | None = None,
    ) -> None:
        self.on_step = on_step
        self.on_end = on_end

    def launched(self, step: Step) -> None:
        self.on_step("launch", step)

    def finalized(self, step: Step) -> None:
        self.on_step("finalize", step)

    def committed(self, step: Step) -> None:
        self.on_step("commit", step)

    def ended(self, seq: Sequence, event: Finished | EngineError) -> None:
        if self.on_end is not None:
            self.on_end(seq, event)
