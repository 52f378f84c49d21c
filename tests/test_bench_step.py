"""bench.step_bench on the CPU (tiny model): the host tick is reported with and without the
commit's wait for results, and the scheduler tells the observer of every wait."""

from __future__ import annotations

import asyncio

import torch

from bench.step_bench import StepRecorder, run_case
from vlm_server.models.interface import LoadedModel


def test_every_commit_reports_its_wait_and_the_tick_its_own_work(tiny: LoadedModel) -> None:
    class Counting(StepRecorder):
        def __init__(self) -> None:
            super().__init__()
            self.waits: list[float] = []
            self.commit_count = 0

        def waited(self, seconds: float) -> None:
            self.waits.append(seconds)
            super().waited(seconds)

        def committed(self, step: object) -> None:
            self.commit_count += 1
            super().committed(step)  # type: ignore[arg-type]

    torch.set_num_threads(1)
    rec = Counting()
    row = asyncio.run(run_case(tiny, 2, 6, 2, False, 32 << 20, observer=rec))
    assert rec.commit_count > 0 and len(rec.waits) == rec.commit_count
    assert all(w >= 0 for w in rec.waits)
    # Each tick's wait happened inside its commit part.
    assert rec.host and all(0 <= wait <= commit for commit, _, _, wait in rec.host)
    assert row["host_wait_ms"] >= 0 and row["host_busy_ms"] >= 0
