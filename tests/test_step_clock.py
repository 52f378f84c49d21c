"""The scheduler's step clock: the last period and the histogram of decode rows' gaps."""

from __future__ import annotations

import pytest

from vlm_server.engine.api import STEP_INTERVAL_BOUNDS_MS
from vlm_server.engine.core.step_clock import StepClock

# Commit times a binary fraction of a second apart, so the gaps are exact in floats.
MS = 2.0**-10  # 0.9765625 ms


def test_only_steps_with_decode_rows_end_a_gap_but_every_commit_sets_the_period() -> None:
    clock = StepClock()
    clock.committed(10.0, decode_rows=True)  # the first commit ends nothing
    assert clock.last_step_ms == 0.0 and sum(clock.interval_counts) == 0
    clock.committed(10.0 + 2 * MS, decode_rows=True)  # a gap of 1.95 ms
    clock.committed(10.0 + 3 * MS, decode_rows=False)  # prompts only: a period, not a gap
    clock.committed(10.0 + 10 * MS, decode_rows=True)  # 6.84 ms after the last commit
    assert clock.last_step_ms == pytest.approx(7 * MS * 1e3)
    counts = clock.interval_counts
    assert sum(counts) == 2 and clock.interval_sum_ms == pytest.approx(9 * MS * 1e3)
    assert counts[STEP_INTERVAL_BOUNDS_MS.index(2.0)] == 1  # (1.5, 2.0]
    assert counts[STEP_INTERVAL_BOUNDS_MS.index(8.0)] == 1  # (6.0, 8.0]
    clock.committed(20.0, decode_rows=True)  # a stall past every bound
    assert counts[-1] == 1
