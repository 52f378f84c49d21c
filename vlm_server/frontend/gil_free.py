"""Copies of large buffers that leave the GIL to the event loop.

A copy of tens of megabytes into new memory is one C call that holds the GIL throughout (on a
busy 2-core machine a 30 MB slice took about 40 ms, most of it faulting in the new pages), so
a worker thread making it stalls the event loop as surely as the loop making it itself. Here
the new object is allocated empty and filled by `ctypes.memmove`, which releases the GIL, a
step at a time: the loop waits at most one step between them.

Only new, not yet shared objects are filled, as C extensions fill them (CPython's layout:
the contents of a bytes object or of a compact ASCII str follow its header).
"""

from __future__ import annotations

import ctypes
import sys

STEP_BYTES = 1 << 20  # bytes one memmove copies

_BYTES_HEADER = sys.getsizeof(b"") - 1  # the bytes object's size without its trailing NUL
_ASCII_HEADER = sys.getsizeof("") - 1

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_new_str = ctypes.pythonapi.PyUnicode_New
_new_str.restype = ctypes.py_object
_new_str.argtypes = (ctypes.c_ssize_t, ctypes.c_uint32)


def _fill(target: object, header: int, data: bytes, start: int, end: int) -> None:
    if type(data) is not bytes or not 0 <= start <= end <= len(data):
        raise ValueError("a copy out of a bytes object, within it")
    dst = id(target) + header
    src = id(data) + _BYTES_HEADER
    for i in range(start, end, STEP_BYTES):
        ctypes.memmove(dst + i - start, src + i, min(STEP_BYTES, end - i))


def bytes_of(data: bytes, start: int = 0, end: int | None = None) -> bytes:
    """``data[start:end]``, copied with the GIL released."""
    end = len(data) if end is None else end
    if end - start <= STEP_BYTES:
        return data[start:end]
    out: bytes = _new_bytes(None, end - start)
    _fill(out, _BYTES_HEADER, data, start, end)
    return out


def is_ascii(data: bytes, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` is all ASCII, looked at a step at a time."""
    return all(data[i : min(end, i + STEP_BYTES)].isascii() for i in range(start, end, STEP_BYTES))


def ascii_text(data: bytes, start: int, end: int) -> str:
    """``data[start:end]`` decoded as ASCII, copied with the GIL released; the caller has
    checked that it is ASCII (`is_ascii`)."""
    if end - start <= STEP_BYTES:
        return data[start:end].decode("ascii")
    out: str = _new_str(end - start, 127)
    _fill(out, _ASCII_HEADER, data, start, end)
    return out
