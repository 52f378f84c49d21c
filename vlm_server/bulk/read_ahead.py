"""Preparing a batch's lines on threads ahead of the engine: reading a picture or a long
request line, and turning it into a body, never runs on the event loop."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from typing import TypeVar

Job = TypeVar("Job")
Made = TypeVar("Made")


async def read_ahead(
    jobs: Iterable[Job], make: Callable[[Job], Made], ahead: int, executor: Executor
) -> AsyncIterator[Made]:
    """``make(job)`` for every job, run on ``executor`` with up to ``ahead`` of them started
    before they are wanted; yielded in the jobs' order. ``jobs`` is iterated on the loop, so
    it must be cheap (a list of paths or offsets); ``make`` must return its failures as
    values, since one raised ends the iteration."""
    if ahead < 1:
        raise ValueError(f"ahead: must be >= 1, got {ahead}")
    loop = asyncio.get_running_loop()
    pending: collections.deque[asyncio.Future[Made]] = collections.deque()
    source = iter(jobs)
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < ahead:
                try:
                    job = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append(loop.run_in_executor(executor, make, job))
            if not pending:
                return
            yield await pending.popleft()
    finally:  # closed early (a stop): what has not started never does
        for future in pending:
            future.cancel()
