"""Keeping the process's heap from growing past what it uses (glibc malloc only).

Every request allocates a few large buffers (decoded pixels, crops, encoder inputs: 1 to
15 MB each) on decode threads and the engine thread. glibc serves a block above its mmap
threshold with a mapping of its own, returned to the kernel on free, but the first such
free raises the threshold to that block's size (up to 32 MiB): from then on the buffers
come from per-thread arenas, whose freed memory stays mapped, fragmented between live
blocks. Resident memory then settles far above the live data and never comes back (measured
with bench/soak.py: docs/deployment.md). Hence:

- `limit_mmap_threshold` fixes the threshold (a fixed value turns the raising off), so
  large buffers always go back to the kernel when freed;
- `limit_arenas` caps the arenas, so threads reuse each other's freed small blocks;
- `trim` returns free pages inside the heaps.

Freed is not enough: a cancelled or expired request leaves its image (megabytes of crops)
in a reference cycle inside the engine, and Python's full collection, the only one that
frees it, runs rarely and scans every object of the loaded model (~0.3 s). `freeze` moves
the objects alive once the model is loaded out of the collector's sight, after which a
full collection takes milliseconds; `Trimmer` runs one, then `trim`, every few seconds.

Elsewhere (musl, macOS) these are no-ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging

log = logging.getLogger(__name__)

# mallopt parameter numbers, from glibc's malloc.h.
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit systems


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


def limit_mmap_threshold(nbytes: int) -> bool:
    """Allocations of ``nbytes`` or more get their own mapping, returned on free (0 leaves
    glibc's self-raising default); True if set."""
    libc = _libc()
    if nbytes < 1 or libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, min(nbytes, MAX_MMAP_THRESHOLD)))


def trim() -> bool:
    """Return free heap pages of every arena to the kernel; True if any were released."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def freeze() -> None:
    """Exempt every object alive now (the loaded model, the server) from garbage collection:
    later full collections scan only what requests create. Call once, when ready."""
    gc.collect()
    gc.freeze()


class Trimmer:
    """Every ``interval`` seconds: a full garbage collection (cycles left by ended requests),
    then `trim` in a worker thread."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            gc.collect()
            await asyncio.to_thread(trim)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
