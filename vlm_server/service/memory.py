"""Keeping the process's heap from growing past what it uses (glibc malloc only).

Image decoding runs on several threads, and glibc gives each thread that allocates under
contention an arena of its own (up to 8 per core). Memory freed in an arena stays mapped
there for that arena's next allocation, so a burst of large decodes leaves every arena
holding its peak: resident memory settles far above the live data. Fewer arenas
(`limit_arenas`) let the threads reuse each other's freed memory, and `trim` hands free
pages back to the kernel; `Trimmer` runs it periodically, off the event loop.
Elsewhere (musl, macOS) these are no-ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def limit_arenas(count: int) -> bool:
    """At most ``count`` malloc arenas from now on (0 leaves glibc's default); True if set.

    Call early: arenas already created by running threads stay."""
    libc = _libc()
    if count < 1 or libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))


def trim() -> bool:
    """Return free heap pages of every arena to the kernel; True if any were released."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


class Trimmer:
    """Calls `trim` every ``interval`` seconds in a worker thread while running."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval > 0 and _libc() is not None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.to_thread(trim)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
