"""What tests and benchmarks can watch, given once at construction (production uses the no-op).

The scheduler calls the step hooks in pipeline order; the runtime records device timing events
only when ``device_timing`` is set, so production pays nothing for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_server.engine.api import EngineError, Finished
    from vlm_server.engine.core.pipeline import Step
    from vlm_server.engine.core.sequence import Sequence


class Observer:
    """Every hook is a no-op; subclasses override what they watch."""

    # The runtime records (start, end) events around each forward and each sampling.
    device_timing: bool = False

    def launched(self, step: Step) -> None:
        """A forward was enqueued into ``step.slot``."""

    def finalized(self, step: Step) -> None:
        """Masks and sampling of ``step`` were enqueued (from committed state)."""

    def committed(self, step: Step) -> None:
        """The host is about to read ``step``'s results (its one wait comes next)."""

    def ended(self, seq: Sequence, event: Finished | EngineError) -> None:
        """``seq`` got its final event (result or error)."""

    def released(self, seq: Sequence) -> None:
        """``seq``'s pages and row are about to be returned (no step in flight holds it)."""

    def waited(self, seconds: float) -> None:
        """The host blocked ``seconds`` on a step's results, inside the commit that `tick`
        then reports (so the tick's own work is its parts less this)."""

    def tick(self, commit_s: float, finalize_s: float, launch_s: float) -> None:
        """Host seconds spent in each part of one scheduler tick."""

    def forward_timed(self, kind: str, start: object, end: object) -> None:
        """Device events around one forward (``kind``: the step's `LaunchKind` value, mixed or
        decode; a mixed step's includes the image prefixes it computes)."""

    def sample_timed(self, start: object, end: object) -> None:
        """Device events around one step's masks + sampling."""

    def closed(self) -> None:
        """The engine stopped: no hook is called after this one."""


NO_OBSERVER = Observer()
