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


def _paced(
    pace_ms: float, **harness: object
) -> tuple[Harness, Clock, list[tuple[float, LaunchKind]]]:
    h = Harness(**{"max_batch_size": 4, "reserved": 0, "decode_pace_ms": pace_ms, **harness})  # type: ignore[arg-type]
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
@pytest.mark.parametrize("field", ["decode_pace_ms", "background_pace_ms"])
def test_the_pace_is_bounded_naming_its_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be in 0\.\.1000"):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def _gaps(launches: list[tuple[float, LaunchKind]], start: int) -> list[float]:
    decode = [t for t, kind in launches[start:] if kind is LaunchKind.DECODE]
    return [b - a for a, b in itertools.pairwise(decode)]


def test_background_steps_give_way_to_an_interactive_picture_on_its_lane() -> None:
    """With `background_pace_ms`, decode steps of background rows alone are paced while an
    interactive picture runs on its lane; not before it, not once it is done, not a step that
    carries interactive rows; and a background picture alone does not pace them."""
    h, clock, launches = _paced(
        0.0, max_batch_size=6, interactive_batch=2, background_pace_ms=10.0, reserved=2
    )
    for i in range(2):
        h.submit(f"bg{i}", priority=-1, max_tokens=60)
    for _ in range(6):
        h.tick()
    assert clock.sleeps == []  # nothing interactive: back to back
    h.submit("bgpic", priority=-1, image="b1", max_tokens=2)
    for _ in range(4):
        h.tick()
    assert h.s.pending_prefixes and not any(e.interactive_lane for e in h.s.pending_prefixes)
    assert clock.sleeps == []  # a background picture alone does not pace
    h.rt.finish_batches()
    h.submit("look", priority=0, image="p1", max_tokens=3)
    h.tick()
    assert any(e.interactive_lane for e in h.s.pending_prefixes)
    start = len(launches)
    for _ in range(6):
        h.tick()
    gaps = _gaps(launches, start)
    assert len(gaps) >= 2 and all(g >= 0.010 - 1e-12 for g in gaps)
    assert clock.sleeps and all(0 < s <= 0.010 + 1e-12 for s in clock.sleeps)
    slept = len(clock.sleeps)
    h.submit("chat", priority=0, max_tokens=8)  # an interactive stream joins the steps
    for _ in range(6):
        h.tick()
    assert any(e.interactive_lane for e in h.s.pending_prefixes)
    assert len(clock.sleeps) == slept  # its steps are not the background's alone
    h.rt.finish_batches()
    h.run()
    h.all_ended()
    slept = len(clock.sleeps)
    h.submit("bg9", priority=-1, max_tokens=8)
    h.run()
    assert len(clock.sleeps) == slept  # the lane empty again: no pace


def test_a_queue_waiting_for_rows_alone_does_not_pace() -> None:
    h, clock, _ = _paced(5.0)
    h.submit("stream", max_tokens=30)
    for i in range(8):  # more than the rows: the rest wait, no picture anywhere
        h.submit(f"q{i}", max_tokens=30)
    for _ in range(10):
        h.tick()
    assert h.s.waiting and not h.s.pending_prefixes
    assert clock.sleeps == []
