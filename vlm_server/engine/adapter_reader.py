"""Reading adapter files in child processes, so that no load holds the engine's GIL.

Unpickling a ``.pt`` file, renaming its keys, checking every tensor and packing them into a
slot's layout is a few hundred milliseconds of Python per adapter; on a loader thread of the
engine it took the GIL from the scheduler thread (a step's gaps grew while an adapter
loaded). `AdapterReader` runs that work in plain child processes (started on first use, kept
for the next; never a fork of the server, whose threads a fork would copy mid-state), each
writing the packed adapter (models/lora/layout.py's slot, or with expert layers
models/lora/experts.py's transfer layout; the bank's dtype) into a buffer it shares with
this process. The parent only waits on a pipe (no GIL held) and then copies the buffer into
the bank's staging memory in one tensor copy, which releases the GIL.

Bounded: at most ``children`` reads at once, the rest wait their turn. A refusal (missing
tensors, shapes, rank, an unreadable file) comes back as the `AdapterError` the same checks
raise in process, message and all; a child that dies, hangs past ``READ_S`` or outlives its
request's deadline is killed and replaced on the next read.
"""

from __future__ import annotations

import atexit
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from vlm_server.models.lora import formats
from vlm_server.models.lora.files import AdapterError
from vlm_server.models.lora.layout import Packing

_POLL_S = 0.05
_START_S = 120.0  # a child's start-up (torch's import): generous, a loaded machine is slow
READ_S = 300.0  # the longest one read may take (the largest file allowed is 4 GiB)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def serve(sock_fd: int, buf_fd: int) -> None:
    """The child's entry point: read each adapter it is sent into the shared buffer, until
    the pipe closes. Answers ``"ready"`` once imported."""
    # One thread and a lower priority: the server's threads win any contention for cores.
    torch.set_num_threads(1)
    os.nice(10)
    conn = Connection(sock_fd)
    conn.send("ready")
    size, view = 0, None
    while True:
        try:
            path, name, layout, dtype, nbytes = conn.recv()
        except (EOFError, OSError):
            return
        if nbytes != size:  # the parent sized the buffer for this layout
            size = nbytes
            view = torch.frombuffer(mmap.mmap(buf_fd, size), dtype=torch.uint8)
        assert view is not None
        try:
            reply: Any = ("ok", read_into(Path(path), name, layout, view.view(dtype)))
        except AdapterError as err:
            reply = ("error", str(err), err.retryable)
        except Exception as err:  # a bug or an odd file: refuse it, keep serving
            reply = ("error", f"adapter {name!r}: cannot read its file: {err}", False)
        conn.send(reply)


def read_into(path: Path, name: str, layout: Packing, flat: torch.Tensor) -> int:
    """Read, rename and check ``path`` in its family's format (models/lora/formats.py), pack
    it into ``flat`` [numel]; its rank. What a child runs; tests call it in process too."""
    weights = formats.load(path, layout.targets, layout.max_rank, name)
    layout.pack(weights, flat)
    return weights.rank


class _Stopped(Exception):
    """The child's pipe closed or the child exited."""


@dataclass
class _Child:
    process: subprocess.Popen
    conn: Connection
    fd: int  # the shared buffer's file
    size: int = 0
    view: torch.Tensor | None = None  # this process's map of the buffer, as bytes

    def alive(self) -> bool:
        return self.process.poll() is None

    def resize(self, nbytes: int) -> torch.Tensor:
        if nbytes != self.size:
            os.ftruncate(self.fd, nbytes)
            # The old map closes once no tensor of a past read refers to it.
            self.view = torch.frombuffer(mmap.mmap(self.fd, nbytes), dtype=torch.uint8)
            self.size = nbytes
        assert self.view is not None
        return self.view

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.wait(5)
        os.close(self.fd)


@dataclass
class ReadResult:
    """A packed slot in a child's shared buffer: ``packed`` [numel] in the bank's dtype,
    valid until `release` (which frees the child for the next read; idempotent)."""

    rank: int
    packed: torch.Tensor
    _release: Any = field(repr=False)

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class AdapterReader:
    """Child processes reading adapter files, at most ``children`` at once."""

    def __init__(self, children: int = 2) -> None:
        self.children = children
        self._cv = threading.Condition()
        self._idle: list[_Child] = []
        self._count = 0  # children alive or starting, idle or not
        self._closed = False
        self.started = 0  # children spawned (a killed one is replaced)

    def read(
        self,
        path: Path,
        name: str,
        layout: Packing,
        dtype: torch.dtype,
        until: float | None = None,
    ) -> ReadResult:
        """Adapter ``name`` from ``path`` packed as ``layout`` says, in ``dtype``. Raises
        `AdapterError` (the file's refusal, or a reader failure: retryable) or TimeoutError
        (``until``, a ``time.monotonic()`` deadline, passed)."""
        nbytes = layout.numel * dtype.itemsize
        for attempt in range(2):
            child = self._take(until)
            try:
                view = child.resize(nbytes)
                child.conn.send((str(path), name, layout, dtype, nbytes))
                reply = self._wait(child, name, until)
            except TimeoutError:  # an OSError too: caught first
                self._discard(child)
                raise
            except (_Stopped, OSError):  # a dead child's pipe refuses the job too
                self._discard(child)
                if attempt:  # a fresh child stopped too: the file may be what stops it
                    raise AdapterError(
                        f"adapter {name!r}: the adapter reader stopped while reading it; retry",
                        retryable=True,
                    ) from None
                continue  # the child had died while idle: once more with a new one
            except BaseException:
                self._discard(child)
                raise
            break
        if reply[0] != "ok":
            self._give_back(child)
            _, message, retryable = reply
            raise AdapterError(message, retryable)
        return ReadResult(reply[1], view.view(dtype), lambda: self._give_back(child))

    def _wait(self, child: _Child, name: str, until: float | None) -> Any:
        hard = time.monotonic() + READ_S
        while True:
            now = time.monotonic()
            if until is not None and now >= until:
                raise TimeoutError(name)
            if now >= hard:
                raise AdapterError(f"adapter {name!r}: reading its file took over {READ_S:g} s")
            try:
                if child.conn.poll(_POLL_S):
                    return child.conn.recv()
            except (EOFError, OSError):
                raise _Stopped from None
            if not child.alive():
                raise _Stopped

    def _take(self, until: float | None) -> _Child:
        with self._cv:
            while True:
                if self._closed:
                    raise AdapterError("the adapter reader is closed", retryable=True)
                while self._idle:
                    child = self._idle.pop()
                    if child.alive():
                        return child
                    self._count -= 1
                    child.kill()
                if self._count < self.children:
                    self._count += 1
                    break
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no adapter reader came free")
                self._cv.wait(left)
        try:
            return self._spawn()  # seconds (imports): outside the lock
        except BaseException:
            with self._cv:
                self._count -= 1
                self._cv.notify()
            raise

    def _give_back(self, child: _Child) -> None:
        with self._cv:
            if self._closed:
                self._count -= 1
                child.kill()
            else:
                self._idle.append(child)
            self._cv.notify()

    def _discard(self, child: _Child) -> None:
        child.kill()
        with self._cv:
            self._count -= 1
            self._cv.notify()

    def _spawn(self) -> _Child:
        # A plain child that imports the adapter code only (a multiprocessing child would
        # import the server's main module); its buffer is an anonymous shared file.
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("adapter-slot")
        else:
            fd, tmp = tempfile.mkstemp(prefix="adapter-slot-")
            os.unlink(tmp)
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        code = f"from {__name__} import serve; serve({theirs.fileno()}, {fd})"
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(theirs.fileno(), fd), env=env
            )
        except BaseException:
            ours.close()
            os.close(fd)
            raise
        finally:
            theirs.close()
        child = _Child(process, Connection(ours.detach()), fd)
        self.started += 1
        try:
            ready = child.conn.poll(_START_S) and child.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            child.kill()
            raise AdapterError("the adapter reader did not start; retry", retryable=True)
        return child

    def warm(self) -> None:
        """Start a child now (if none is), so that the first read does not wait for its
        imports; a failure here only leaves that to the first read."""
        with self._cv:
            if self._count or self._closed:
                return
            self._count += 1
        try:
            child = self._spawn()
        except Exception:  # the first read will try again, and report what fails
            with self._cv:
                self._count -= 1
                self._cv.notify()
            return
        self._give_back(child)

    def close(self) -> None:
        """Stop every idle child; busy ones stop when their read is released."""
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cv.notify_all()
        for child in idle:
            child.kill()

    @property
    def pids(self) -> Sequence[int]:
        """The idle children's process ids."""
        with self._cv:
            return [c.process.pid for c in self._idle if c.alive()]


_shared: AdapterReader | None = None
_shared_lock = threading.Lock()


def shared_reader() -> AdapterReader:
    """This process's reader (every engine in it shares the children: each costs a Python
    with torch imported), stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = AdapterReader()
            atexit.register(_shared.close)
        return _shared
