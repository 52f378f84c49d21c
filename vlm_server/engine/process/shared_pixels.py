"""Decoded pixels the server and its engine process both map: anonymous shared memory
(``memfd``), handed over as a file descriptor, so an image crosses without a copy.

The server decodes a JPEG straight into `shared_array`; the engine process maps the same
pages read-only (`attach`) and makes the crops from them on its own device. The memory is
anonymous, not a file under /dev/shm, so its size is bounded by the process's memory, not
by the (often small) tmpfs of a container. It is freed once both sides dropped it.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref

import numpy as np


class _SharedMap(mmap.mmap):
    """A mapping of a memfd that remembers the descriptor (closed with the mapping)."""

    fd: int


def shared_array(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array of ``shape`` in shared memory another process can map."""
    size = math.prod(shape)
    fd = os.memfd_create("vlm-pixels", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(size, 1))
        mapping = _SharedMap(fd, max(size, 1))
    except BaseException:
        os.close(fd)
        raise
    mapping.fd = fd
    weakref.finalize(mapping, os.close, fd)
    return np.frombuffer(mapping, np.uint8, size).reshape(shape)


def shared_fd(array: np.ndarray) -> int | None:
    """The memfd behind ``array`` if it is a whole `shared_array` (else None)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, _SharedMap) or not array.flags.c_contiguous:
        return None
    if array.nbytes != len(base) and not (array.nbytes == 0 and len(base) == 1):
        return None
    return base.fd


def share(array: np.ndarray) -> np.ndarray:
    """``array`` itself if it is shared already, else a shared copy of it."""
    if shared_fd(array) is not None:
        return array
    copy = shared_array(array.shape)
    copy[...] = array
    return copy


def attach(fd: int, shape: tuple[int, ...]) -> np.ndarray:
    """Map a received memfd read-only as uint8 ``shape``; takes ownership of ``fd``."""
    size = math.prod(shape)
    try:
        mapping = mmap.mmap(fd, max(size, 1), prot=mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return np.frombuffer(mapping, np.uint8, size).reshape(shape)
