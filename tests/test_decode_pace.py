"""Decode pacing (EngineConfig.decode_pace_ms, scheduler `_pace`), on the script runtime with
the scheduler's clock and sleep driven by the test: while a new picture runs on the image
path, decode steps start no sooner than the pace after the last one (the scheduler sleeps the
rest, events sent first); with no picture pending, a queue waiting for rows alone, or no pace,
they run back to back; every request still ends."""

from __future__ import annotations

import itertools

import pytest

from tests.test_scheduler_priorities import Harness
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.pipeline import LaunchKind, Step


class Clock:
    """Time that passes only when the scheduler sleeps."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def _paced(pace_ms: float) -> tuple[Harness, Clock, list[tuple[float, LaunchKind]]]:
    h = Harness(max_batch_size=4, reserved=0, decode_pace_ms=pace_ms)
    clock = Clock()
    h.s.now, h.s.sleep = clock.now, clock.sleep
    launches: list[tuple[float, LaunchKind]] = []
    counted = h.steps.launched

    def launched(step: Step) -> None:
        launches.append((clock.t, step.kind))
        counted(step)

    h.steps.launched = launched  # type: ignore[method-assign]
    return h, clock, launches


def test_decode_steps_wait_for_the_pace_only_while_a_picture_is_pending() -> None:
    h, clock, launches = _paced(5.0)
    h.submit("stream", max_tokens=40)
    for _ in range(6):  # no picture anywhere: back to back
        h.tick()
    assert clock.sleeps == [] and len(launches) >= 4
    h.submit("picture", image="p1", max_tokens=2)
    h.tick()  # admitted: its prefix batch runs on the image path, not finished
    assert h.s.pending_prefixes
    start = len(launches)
    for _ in range(6):
        h.tick()
    paced = [t for t, kind in launches[start:] if kind is LaunchKind.DECODE]
    assert len(paced) >= 3
    assert all(b - a >= 0.005 - 1e-12 for a, b in itertools.pairwise(paced))
    assert clock.sleeps and all(0 < s <= 0.005 + 1e-12 for s in clock.sleeps)
    h.rt.finish_batches()
    h.run()
    h.all_ended()
    slept = len(clock.sleeps)
    h.submit("after", max_tokens=6)
    h.run()
    assert len(clock.sleeps) == slept  # nothing pending again: no pace


def test_no_pace_never_sleeps() -> None:
    h, clock, _ = _paced(0.0)
    h.submit("stream", max_tokens=20)
    h.submit("picture", image="p1", max_tokens=3)
    for _ in range(8):
        h.tick()
    h.rt.finish_batches()
    h.run()
    h.all_ended()
    assert clock.sleeps == []


@pytest.mark.parametrize("value", [-1.0, 1001.0])
def test_the_pace_is_bounded_naming_its_field(value: float) -> None:
    with pytest.raises(ValueError, match=r"decode_pace_ms must be in 0\.\.1000"):
        EngineConfig(decode_pace_ms=value)


def test_a_queue_waiting_for_rows_alone_does_not_pace() -> None:
    h, clock, _ = _paced(5.0)
    h.submit("stream", max_tokens=30)
    for i in range(8):  # more than the rows: the rest wait, no picture anywhere
        h.submit(f"q{i}", max_tokens=30)
    for _ in range(10):
        h.tick()
    assert h.s.waiting and not h.s.pending_prefixes
    assert clock.sleeps == []
