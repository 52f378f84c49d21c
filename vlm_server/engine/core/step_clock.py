"""The time between the scheduler's commits: the last step's period, and a histogram of the
gaps running streams saw (`EngineStats.step_interval_counts`)."""

from __future__ import annotations

import bisect

from vlm_server.engine.api import STEP_INTERVAL_BOUNDS_MS


class StepClock:
    """Fed each commit's monotonic time; a commit of a step with decode rows ends a gap those
    rows waited for their token (a step of prompts only ends none)."""

    def __init__(self) -> None:
        self.last_step_ms = 0.0
        self.interval_counts = [0] * (len(STEP_INTERVAL_BOUNDS_MS) + 1)
        self.interval_sum_ms = 0.0
        self._last_at = 0.0

    def committed(self, now: float, decode_rows: bool) -> None:
        if self._last_at:
            self.last_step_ms = ms = (now - self._last_at) * 1e3
            if decode_rows:
                self.interval_counts[bisect.bisect_left(STEP_INTERVAL_BOUNDS_MS, ms)] += 1
                self.interval_sum_ms += ms
        self._last_at = now
