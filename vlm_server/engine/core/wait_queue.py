"""The scheduler's waiting requests: a priority queue, first in first out within a priority
(CUDA-free).

Admission takes the head: the oldest of the highest priority. It keeps the deque operations
the scheduler and the engine use (``[0]``, `popleft`, `remove`, `append`, `extend`, iteration
in admission order, ``len``, truthiness). Each priority is a deque of its own and the
priorities present are kept sorted, so an operation costs O(1) plus O(levels) when a priority
appears or empties (a handful of levels: clients send -10..10); `remove` scans its item's
priority only, as a deque's does.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Generic, TypeVar

T = TypeVar("T")


class WaitQueue(Generic[T]):
    """Items by ``priority_of`` (higher first), FIFO within one priority. An item's priority
    must not change while it is queued."""

    def __init__(self, priority_of: Callable[[T], int], items: Iterable[T] = ()) -> None:
        self._priority_of = priority_of
        self._levels: dict[int, deque[T]] = {}
        self._keys: list[int] = []  # the negated priorities present, ascending: head first
        self._len = 0
        self.extend(items)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        """In admission order."""
        return chain.from_iterable([self._levels[-k] for k in self._keys])

    def __contains__(self, item: object) -> bool:
        return any(item in q for q in self._levels.values())

    def __getitem__(self, index: int) -> T:
        """The item ``index`` places from the head (``[0]``: the next one admitted)."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("wait queue index out of range")
        for k in self._keys:
            level = self._levels[-k]
            if index < len(level):
                return level[index]
            index -= len(level)
        raise AssertionError("the levels hold fewer items than counted")

    def head_priority(self) -> int:
        """The priority of ``[0]``; IndexError when empty."""
        if not self._keys:
            raise IndexError("head of an empty wait queue")
        return -self._keys[0]

    def append(self, item: T) -> None:
        priority = self._priority_of(item)
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = deque()
            bisect.insort(self._keys, -priority)
        level.append(item)
        self._len += 1

    def extend(self, items: Iterable[T]) -> None:
        for item in items:
            self.append(item)

    def popleft(self) -> T:
        """Take the head; IndexError when empty."""
        if not self._keys:
            raise IndexError("pop from an empty wait queue")
        priority = -self._keys[0]
        level = self._levels[priority]
        item = level.popleft()
        self._len -= 1
        if not level:
            self._drop(priority)
        return item

    def remove(self, item: T) -> None:
        """Take ``item`` out (compared as a deque compares); ValueError when absent."""
        priority = self._priority_of(item)
        level = self._levels.get(priority)
        if level is None:
            raise ValueError("item not in the wait queue")
        level.remove(item)
        self._len -= 1
        if not level:
            self._drop(priority)

    def _drop(self, priority: int) -> None:
        del self._levels[priority]
        del self._keys[bisect.bisect_left(self._keys, -priority)]
