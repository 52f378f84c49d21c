"""Processes started when the test run starts, each taken over once by the test it is for.

Some tests drive a command of their own that takes many seconds to start (Ray and its
replicas, a server loading its model, an engine process), mostly in processes that leave the
run's core idle: the run starts them together with its first test (see conftest.py), and
their test takes them over with `take`, or starts one then when none was started early (a
run of that test alone, say). Each is the test's own: no other test uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

import pytest


class Stoppable(Protocol):
    def stop(self) -> None: ...


T = TypeVar("T", bound=Stoppable)

_started: dict[Hashable, Stoppable] = {}


def launch(key: Hashable, start: Callable[[], Stoppable]) -> None:
    if key not in _started:
        _started[key] = start()


def take(key: Hashable, start: Callable[[], T]) -> T:
    """The process started early for ``key`` (once), else one started now."""
    early = _started.pop(key, None)
    return early if early is not None else start()  # type: ignore[return-value]


def stop_untaken() -> None:
    """Stops what no test took (its test failed to run, or the run was interrupted)."""
    while _started:
        _, process = _started.popitem()
        process.stop()


def in_run(request: pytest.FixtureRequest, test_name: str) -> bool:
    """Whether the test function ``test_name`` of the requesting module is in this run."""
    return any(
        item.module is request.module and item.originalname == test_name  # type: ignore[attr-defined]
        for item in request.session.items
    )
