"""What crosses between the server and its engine process, and how it is pickled.

Two one-way pipes: commands go down (`Submit`, `Cancel`, `Close`), replies and events come up
(`Ready`, `Accepted`, `Refused`, `Events`, `Stats`). Request ids are the server's; the
engine process answers every `Submit` with exactly one `Accepted` or `Refused`, and a
request's events may arrive before its `Accepted`.

Crops on a CUDA device cross as CUDA IPC handles (torch's sharing: no copy, and the server
keeps the memory until the engine process lets go of it); CPU tensors cross by value.
"""

from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from vlm_server.engine.api import EngineError, EngineInfo, EngineStats, Event, GenerationRequest


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
    """One scheduler tick's events, oldest first."""

    items: list[tuple[int, Event | EngineError]]


@dataclass(frozen=True)
class Stats:
    stats: EngineStats


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return reduce_tensor(obj)
        return NotImplemented


def dumps(message: object) -> bytes:
    """``message`` as bytes; CUDA tensors in it become IPC handles."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


class Sender:
    """Writes whole messages to a pipe from any thread (one at a time)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        data = dumps(message)
        with self._lock:
            self.conn.send_bytes(data)


def recv(conn: Connection) -> object:
    """The next message (blocks); EOFError once the other side is gone."""
    return pickle.loads(conn.recv_bytes())
