"""The prefill launcher: image prefix batches enqueued off the scheduler's thread. Order and
progress only (gates, no clocks): the caller never waits for a launch, a batch is complete
only once enqueued and its event completed, batches go in order, and a failed launch reaches
the scheduler's thread."""

from __future__ import annotations

import threading

import pytest

from vlm_server.engine.device.prefill_launcher import (
    PrefillLauncher,
    PrefixBatch,
    PrefixLaunchError,
)


class _Event:
    """A device event stand-in: done when the test says so."""

    def __init__(self, done: bool = True) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


class _GatedLaunch:
    """A launch that blocks until its gate opens (as a graph replay behind a running one)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.order: list[object] = []
        self.events: list[_Event] = []

    def __call__(self, jobs: list, partitioned: bool) -> _Event:
        self.started.set()
        self.gate.wait()
        self.order.append((tuple(jobs), partitioned))
        event = _Event()
        self.events.append(event)
        return event


def test_inline_launch_enqueues_at_once_and_delegates_to_the_event() -> None:
    event = _Event(done=False)
    launcher = PrefillLauncher(lambda jobs, part: event, threaded=False)
    batch = launcher.submit(["a"])
    assert batch.enqueued and not batch.query()
    event.done.set()
    assert batch.query() and batch.device_event() is event
    launcher.close()


def test_the_caller_goes_on_while_a_launch_blocks_and_batches_keep_their_order() -> None:
    launch = _GatedLaunch()
    launcher = PrefillLauncher(launch, threaded=True)
    try:
        first = launcher.submit(["a"])
        second = launcher.submit(["b", "c"], partitioned=True)
        assert launch.started.wait(30)  # the launcher is inside the first launch, blocked
        # The caller got both handles back; neither batch counts as done before it is enqueued
        # (an unrecorded CUDA event would say "complete").
        assert not first.enqueued and not first.query() and not second.query()
        launch.gate.set()
        second.synchronize()
        assert launch.order == [(("a",), False), (("b", "c"), True)]
        assert first.query() and second.query()
        assert second.device_event() is launch.events[1]
    finally:
        launch.gate.set()
        launcher.close()


def test_a_batch_is_done_only_when_its_device_event_is() -> None:
    event = _Event(done=False)
    launcher = PrefillLauncher(lambda jobs, part: event, threaded=True)
    try:
        batch = launcher.submit(["a"])
        assert batch.device_event() is event  # waits for the enqueue only
        assert batch.enqueued and not batch.query()
        event.done.set()
        batch.synchronize()
        assert batch.query()
    finally:
        launcher.close()


def test_a_failed_launch_is_raised_where_the_scheduler_polls() -> None:
    def launch(jobs: list, partitioned: bool) -> object:
        if jobs == ["bad"]:
            raise ValueError("9 image prefixes in one batch")
        return _Event()

    launcher = PrefillLauncher(launch, threaded=True)
    try:
        batch = launcher.submit(["bad"])
        batch.synchronize()  # the prefix watcher's wait returns; it does not raise
        with pytest.raises(PrefixLaunchError) as info:
            batch.query()
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(PrefixLaunchError):
            batch.device_event()
        # the thread lives on: the next batch is launched
        ok = launcher.submit(["b"])
        ok.synchronize()
        assert ok.query()
    finally:
        launcher.close()


def test_close_enqueues_what_was_handed_over_then_stops() -> None:
    launch = _GatedLaunch()
    launcher = PrefillLauncher(launch, threaded=True)
    batches = [launcher.submit([i]) for i in range(3)]
    launch.gate.set()
    launcher.close()
    assert all(b.enqueued for b in batches) and [o[0] for o in launch.order] == [(0,), (1,), (2,)]
    launcher.close()  # twice: nothing left to stop


def test_a_handle_is_not_an_event_until_settled() -> None:
    batch = PrefixBatch()
    assert not batch.enqueued and not batch.query()
    batch.settle(_Event(), None)
    assert batch.query()


def test_a_batch_that_cannot_block_runs_in_the_callers_thread_unless_others_wait() -> None:
    launch = _GatedLaunch()
    threads: list[str] = []

    def recording(jobs: list, partitioned: bool) -> _Event:
        threads.append(threading.current_thread().name)
        return launch(jobs, partitioned)

    launcher = PrefillLauncher(recording, threaded=True)
    try:
        launch.gate.set()
        alone = launcher.submit(["a"], inline=True)
        assert alone.enqueued and threads == [threading.current_thread().name]
        launch.gate.clear()
        launch.started.clear()
        handed = launcher.submit(["b"])  # may block: the thread takes it
        assert launch.started.wait(30)
        after = launcher.submit(["c"], inline=True)  # behind "b": the thread keeps the order
        assert not after.enqueued
        launch.gate.set()
        after.synchronize()
        assert [o[0] for o in launch.order] == [("a",), ("b",), ("c",)]
        assert threads[1:] == ["prefill-launcher", "prefill-launcher"] and handed.query()
    finally:
        launch.gate.set()
        launcher.close()
