"""Preparing a batch's lines on threads ahead of the engine: reading a picture or a long
request line, and turning it into a body, never runs on the event loop."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from typing import Generic, Protocol, TypeVar

from vlm_server.bulk.runner import Item

Job = TypeVar("Job")
Made = TypeVar("Made")


class Line(Protocol):
    @property
    def custom_id(self) -> str: ...


L = TypeVar("L", bound=Line)


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


class LineSource(Generic[L]):
    """A batch's lines, each made into its request (or why it cannot run) on a thread ahead
    of the engine; a subclass holds ``lines`` and says how one is made."""

    lines: list[L]

    @property
    def ids(self) -> list[str]:
        return [line.custom_id for line in self.lines]

    def items(self, done: set[str], executor: Executor, ahead: int) -> AsyncIterator[Item]:
        """The lines not in ``done``, each made on ``executor``."""
        todo = [line for line in self.lines if line.custom_id not in done]
        return read_ahead(todo, self.make, ahead, executor)

    def make(self, line: L) -> Item:
        """The request of one line, or why it cannot run (runs on a thread)."""
        raise NotImplementedError
