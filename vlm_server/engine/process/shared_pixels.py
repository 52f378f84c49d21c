"""Decoded pixels the server and its engine process both map: anonymous shared memory
(``memfd``), handed over as a file descriptor, so an image crosses without a copy.

The server decodes a JPEG straight into a buffer of the `PixelPool`; the engine process
maps the same pages read-only (`attach`) and makes the crops from them on its own device.
The memory is anonymous, not a file under /dev/shm, so its size is bounded by the process's
memory, not by the (often small) tmpfs of a container.

Buffers are reused: giving shared pages to a process costs more than decoding into them
(about 1 ms for 800x600 pixels), so a buffer goes back to the pool once the server dropped
its image and the engine process said it let go of every mapping of it (`released`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import mmap
import os
import threading
import weakref

import numpy as np

MIB = 1 << 20
POOL_BYTES = 256 * MIB  # free buffers kept for reuse, at most

_ids = itertools.count(1)


class SharedMap(mmap.mmap):
    """A mapping of a memfd that remembers the descriptor and the pool it belongs to."""

    fd: int
    buffer_id: int
    pool: PixelPool | None


def _new_map(size: int) -> SharedMap:
    fd = os.memfd_create("vlm-pixels", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(size, 1))
        mapping = SharedMap(fd, max(size, 1))
    except BaseException:
        os.close(fd)
        raise
    mapping.fd = fd
    mapping.buffer_id = next(_ids)
    mapping.pool = None
    weakref.finalize(mapping, os.close, fd)
    return mapping


def shared_array(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array of ``shape`` in shared memory another process can map (not
    pooled: its memory goes when it does)."""
    size = math.prod(shape)
    return np.frombuffer(_new_map(size), np.uint8, size).reshape(shape)


class PixelPool:
    """Shared buffers for decoded pixels, reused once neither process uses them.

    A buffer is busy while an array handed out by `array` is alive here, or while the
    engine process holds mappings of it: each send counts one (`sent`), each mapping the
    engine closes takes one back (`released`). Thread-safe.

    An array's death is queued without a lock and applied by the pool's next call: it can
    happen inside a garbage collection that any allocation starts, in a thread that may
    hold the pool's lock at that moment.
    """

    def __init__(self, max_free_bytes: int = POOL_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        self._maps: dict[int, SharedMap] = {}
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._free_bytes = 0
        self._alive: set[int] = set()
        self._outstanding: collections.Counter[int] = collections.Counter()
        self._dead: collections.deque[int] = collections.deque()  # appended lock-free
        self.reused = 0

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 array of ``shape`` in a shared buffer (old contents: write all of it)."""
        size = math.prod(shape)
        with self._lock:
            self._bury()
            mapping = self._take(size)
        if mapping is None:
            mapping = _new_map(size)
            mapping.pool = self
            with self._lock:
                self._maps[mapping.buffer_id] = mapping
        base = np.frombuffer(mapping, np.uint8, size)
        with self._lock:
            self._alive.add(mapping.buffer_id)
        weakref.finalize(base, self._dead.append, mapping.buffer_id)
        return base.reshape(shape)

    def _take(self, size: int) -> SharedMap | None:
        for buffer_id in reversed(self._free):  # the most recently freed: still cached
            mapping = self._maps[buffer_id]
            if len(mapping) == max(size, 1):
                del self._free[buffer_id]
                self._free_bytes -= len(mapping)
                self.reused += 1
                return mapping
        return None

    def sent(self, buffer_id: int) -> None:
        """One more mapping of the buffer in the engine process (it was sent there)."""
        with self._lock:
            self._outstanding[buffer_id] += 1

    def released(self, buffer_ids: list[int]) -> None:
        """The engine process closed one mapping of each of these buffers."""
        with self._lock:
            self._bury()
            for buffer_id in buffer_ids:
                self._outstanding[buffer_id] -= 1
                self._maybe_free(buffer_id)

    def _bury(self) -> None:
        """Apply the deaths of arrays queued since the last call (under the lock)."""
        while self._dead:
            buffer_id = self._dead.popleft()
            self._alive.discard(buffer_id)
            self._maybe_free(buffer_id)

    def _maybe_free(self, buffer_id: int) -> None:
        if buffer_id in self._alive or self._outstanding[buffer_id] > 0:
            return
        del self._outstanding[buffer_id]
        mapping = self._maps.get(buffer_id)
        if mapping is None or buffer_id in self._free:
            return
        self._free[buffer_id] = None
        self._free_bytes += len(mapping)
        while self._free_bytes > self.max_free_bytes:
            oldest, _ = self._free.popitem(last=False)
            self._free_bytes -= len(self._maps.pop(oldest))  # unmapped when unreferenced

    def stats(self) -> tuple[int, int]:
        """(buffers held, free bytes)."""
        with self._lock:
            self._bury()
            return len(self._maps), self._free_bytes


@functools.cache
def pixel_pool() -> PixelPool:
    """This process's pool."""
    return PixelPool()


def shared_map(array: np.ndarray) -> SharedMap | None:
    """The shared buffer behind ``array`` if it is a whole one (else None)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, SharedMap) or not array.flags.c_contiguous:
        return None
    if array.nbytes != len(base) and not (array.nbytes == 0 and len(base) == 1):
        return None
    if array.ctypes.data != np.frombuffer(base, np.uint8, 0).ctypes.data:
        return None
    return base


def shared_fd(array: np.ndarray) -> int | None:
    """The memfd behind ``array`` if it is a whole shared buffer (else None)."""
    mapping = shared_map(array)
    return None if mapping is None else mapping.fd


def share(array: np.ndarray, pool: PixelPool | None = None) -> np.ndarray:
    """``array`` itself if it is shared already, else a shared copy of it (from ``pool``)."""
    if shared_map(array) is not None:
        return array
    copy = pool.array(array.shape) if pool is not None else shared_array(array.shape)
    copy[...] = array
    return copy


# Engine side: buffers whose mapping was closed, to tell the server (`take_released`).
_released: list[int] = []


def attach(fd: int, shape: tuple[int, ...], buffer_id: int = 0) -> np.ndarray:
    """Map a received memfd read-only as uint8 ``shape``; takes ownership of ``fd``. Once
    the array is gone, ``buffer_id`` (if set) is reported by `take_released`."""
    size = math.prod(shape)
    try:
        mapping = mmap.mmap(
            fd, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
        )
    finally:
        os.close(fd)  # the mapping keeps the memory
    base = np.frombuffer(mapping, np.uint8, size)
    if buffer_id:
        weakref.finalize(base, _released.append, buffer_id)
    return base.reshape(shape)


def take_released() -> list[int]:
    """Buffers whose mappings closed since the last call (one entry per mapping)."""
    taken = []
    while _released:
        taken.append(_released.pop())
    return taken
