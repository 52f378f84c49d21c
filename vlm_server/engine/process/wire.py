"""What crosses between the server and its engine process, and how it is pickled.

Two one-way pipes: commands go down (`Submit`, `Cancel`, `Close`), replies and events come up
(`Ready`, `Accepted`, `Refused`, `Events`, `Stats`). Request ids are the server's; the
engine process answers every `Submit` with exactly one `Accepted` or `Refused`, and a
request's events may arrive before its `Accepted`.

Decoded pixels in shared memory (`shared_pixels`), and the encoded bytes of JPEGs left for
the engine process to decode on its GPU, cross as file descriptors, passed beside the
message on a Unix socket. Everything else crosses by value (the server's images are decoded
on the host, or not at all, and cropped by the engine process, so no device memory ever
crosses).
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from vlm_server.engine.api import EngineError, EngineInfo, EngineStats, Event, GenerationRequest
from vlm_server.engine.process.shared_pixels import SharedMap, attach, shared_map


@dataclass(frozen=True)
class Submit:
    rid: int
    request: GenerationRequest


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed:
    message: str


@dataclass(frozen=True)
class Accepted:
    rid: int


@dataclass(frozen=True)
class Refused:
    rid: int
    error: EngineError


@dataclass(frozen=True)
class Events:
    """One scheduler tick's events, oldest first. ``sent_at``: ``time.monotonic()`` when the
    engine process sent them (one clock for every process on Linux; 0: not stamped)."""

    items: list[tuple[int, Event | EngineError]]
    sent_at: float = 0.0


@dataclass(frozen=True)
class Stats:
    stats: EngineStats
    released: list[int]  # pooled pixel buffers the engine process let go of, one per mapping


MAX_FDS = 255  # descriptors one message may carry (its count travels in one byte)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, shared: list[SharedMap]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            mapping = shared_map(obj)
            if mapping is not None:
                self.shared.append(mapping)
                pooled = mapping.buffer_id if mapping.pool is not None else 0
                return (_received_array, (len(self.shared) - 1, obj.shape, pooled))
        return NotImplemented


_received = threading.local()


def _received_array(index: int, shape: tuple[int, ...], buffer_id: int) -> np.ndarray:
    fds: list[int] = _received.fds
    fd, fds[index] = fds[index], -1
    return attach(fd, shape, buffer_id)


def dumps(message: object) -> tuple[bytes, list[SharedMap]]:
    """``message`` as bytes, and the shared buffers in it (their descriptors go beside it)."""
    buffer = io.BytesIO()
    shared: list[SharedMap] = []
    _Pickler(buffer, shared).dump(message)
    return buffer.getvalue(), shared


def loads(data: bytes | memoryview, fds: list[int]) -> object:
    """The message `dumps` made; ``fds`` are the descriptors that came with it (each is
    owned by the array it becomes, or closed here)."""
    _received.fds = list(fds)
    try:
        return pickle.loads(data)
    finally:
        for fd in _received.fds:
            if fd >= 0:
                os.close(fd)
        _received.fds = []


class Sender:
    """Writes whole messages to a pipe from any thread (one at a time); ``fd_socket`` (a
    Unix datagram-ordered socket) carries the descriptors of shared arrays."""

    def __init__(
        self, conn: Connection, fd_socket: socket.socket | None = None, plain: bool = False
    ) -> None:
        self.conn = conn
        self.fd_socket = fd_socket
        # plain: the messages hold no tensors or shared arrays (the engine's replies and
        # events), so the C pickler runs without a Python call per object.
        self.plain = plain
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        if self.plain:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            with self._lock:
                self.conn.send_bytes(b"\0" + data)
            return
        data, shared = dumps(message)
        if len(shared) > MAX_FDS or (shared and self.fd_socket is None):
            raise ValueError(f"cannot send {len(shared)} shared arrays on this channel")
        pooled = [m for m in shared if m.pool is not None]
        for mapping in pooled:  # counted before the other side can say it let go
            mapping.pool.sent(mapping.buffer_id)  # type: ignore[union-attr]
        try:
            with self._lock:
                if shared:
                    fds = [m.fd for m in shared]
                    socket.send_fds(self.fd_socket, [b"\0"], fds)  # type: ignore[arg-type]
                self.conn.send_bytes(bytes((len(shared),)) + data)
        except BaseException:
            for mapping in pooled:
                mapping.pool.released([mapping.buffer_id])  # type: ignore[union-attr]
            raise


def recv(conn: Connection, fd_socket: socket.socket | None = None) -> object:
    """The next message (blocks); EOFError once the other side is gone."""
    raw = conn.recv_bytes()
    count = raw[0]
    fds: list[int] = []
    if count:
        if fd_socket is None:
            raise OSError("a message came with descriptors on a channel without them")
        _, fds, _, _ = socket.recv_fds(fd_socket, 1, count)
        if len(fds) != count:
            for fd in fds:
                os.close(fd)
            raise OSError(f"expected {count} descriptors, got {len(fds)}")
    return loads(memoryview(raw)[1:], fds)
