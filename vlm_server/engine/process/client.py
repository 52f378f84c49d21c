"""The server's side of an engine process: the `Engine` contract over two pipes.

`start` spawns the process and waits for it to load and warm up. Replies and events are
read on the event loop when the pipe is readable (``loop.add_reader``): one message per
scheduler tick, whatever the number of streams. If the process dies, every open request
fails with UNAVAILABLE and so does every later one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any

from vlm_server.engine.api import (
    EngineError,
    EngineInfo,
    EngineStats,
    ErrorCode,
    Event,
    Finished,
    GenerationRequest,
    stream_events,
)
from vlm_server.engine.process.shared_pixels import pixel_pool
from vlm_server.engine.process.wire import (
    Accepted,
    Cancel,
    Close,
    Events,
    Ready,
    Refused,
    Sender,
    StartFailed,
    Stats,
    Submit,
    recv,
)

log = logging.getLogger(__name__)

WORKER_MODULE = "vlm_server.engine.process.worker"

# How long `close` waits for the process to finish its work and exit before killing it.
EXIT_TIMEOUT_S = 30.0


class _RemoteStream:
    """One request's events, as the engine process sends them."""

    def __init__(self, engine: ProcessEngine, rid: int) -> None:
        self._engine = engine
        self.rid = rid
        self._queue: asyncio.Queue[Event | EngineError] = asyncio.Queue()
        self.ended = False  # its final event arrived

    def put(self, event: Event | EngineError) -> None:
        if isinstance(event, Finished | EngineError):
            self.ended = True
        self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[Event]:
        return stream_events(self._queue)

    def cancel(self) -> None:
        if not self.ended:
            self._engine._cancel(self.rid)


class ProcessEngine:
    """An engine that runs in a child process.

    Args:
        factory: builds the engine, in the child. It and the other callables are pickled:
            module-level functions, or partials of them.
        setup: runs first in the child (logging, allocator settings).
        on_ready: runs in the child once the engine started (e.g. freezing the collector).
        housekeeping: runs in the child every ``housekeeping_interval`` seconds.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        setup: Callable[[], None] | None = None,
        on_ready: Callable[[], None] | None = None,
        housekeeping: Callable[[], None] | None = None,
        housekeeping_interval: float = 0.0,
    ) -> None:
        self._factory = factory
        self._setup = setup
        self._on_ready = on_ready
        self._housekeeping = housekeeping
        self._housekeeping_interval = housekeeping_interval
        self.info: EngineInfo | None = None  # type: ignore[assignment]
        self._process: subprocess.Popen[bytes] | None = None
        self._sender: Sender | None = None
        self._events: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._streams: dict[int, _RemoteStream] = {}
        self._admissions: dict[int, asyncio.Future[None]] = {}
        self._stats = EngineStats()
        self._failure: str | None = None
        self._closing = False
        self._draining = False
        self._on_events_delay: Callable[[float], None] | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before `start`)."""
        return self._process.pid if self._process is not None else None

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine process; returns once it serves (raises if it cannot start)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        commands_in, commands_out = os.pipe()
        events_in, events_out = os.pipe()
        # Beside the commands: the descriptors of the shared pixels they carry.
        fds_here, fds_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = pickle.dumps(
            (
                self._factory,
                self._setup,
                self._on_ready,
                self._housekeeping,
                self._housekeeping_interval,
            )
        )
        # A fresh interpreter (CUDA does not survive a fork) that imports only the worker
        # module, whatever the server's own main module is.
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                WORKER_MODULE,
                str(commands_in),
                str(fds_there.fileno()),
                str(events_out),
            ],
            stdin=subprocess.PIPE,
            pass_fds=(commands_in, fds_there.fileno(), events_out),
        )
        os.close(commands_in)
        os.close(events_out)
        fds_there.close()
        self._process = process
        self._sender = Sender(Connection(commands_out, readable=False), fds_here)
        self._events = Connection(events_in, writable=False)
        assert process.stdin is not None
        with process.stdin:
            process.stdin.write(spec)
        try:
            first = await loop.run_in_executor(None, recv, self._events)
        except asyncio.CancelledError:  # the server stops while the engine loads
            process.kill()
            await asyncio.to_thread(process.wait)
            raise
        except (EOFError, OSError):
            code = await loop.run_in_executor(None, process.wait)
            raise RuntimeError(
                f"the engine process exited while starting (exit code {code})"
            ) from None
        if isinstance(first, StartFailed):
            await loop.run_in_executor(None, process.wait)
            raise RuntimeError(f"the engine process failed to start: {first.message}")
        if not isinstance(first, Ready):
            raise RuntimeError(f"the engine process said {type(first).__name__} first")
        self.info = first.info
        loop.add_reader(events_in, self._on_readable)

    async def drain(self, timeout: float) -> None:
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self._streams or self._admissions) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._closing = True
        process = self._process
        if process is None:
            return
        if self._sender is not None and self._failure is None:
            with contextlib.suppress(OSError):
                self._sender.send(Close())
        try:
            await asyncio.to_thread(process.wait, EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not exit in %.0f s: killing it", EXIT_TIMEOUT_S)
            process.kill()
            await asyncio.to_thread(process.wait)
        self._lost("the server is shutting down", ErrorCode.UNAVAILABLE)

    def stats(self) -> EngineStats:
        """The engine's counters as last reported (a few times a second)."""
        return self._stats

    def warm_constraints(self) -> None:
        """Nothing to do here: the engine process warms its compiler once it is ready."""

    def watch_events_delay(self, observe: Callable[[float], None]) -> None:
        """Call ``observe`` with the seconds from the engine process sending each tick's
        events to this loop handing them to their streams: the pipe, and this process's
        waits for its loop and the GIL, that every token crosses."""
        self._on_events_delay = observe

    def failure(self) -> str | None:
        return None if self._closing else self._failure

    # ---- requests ---------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> _RemoteStream:
        """Hand ``request`` to the engine process; raises EngineError if it is refused."""
        self._check_open()
        assert self._sender is not None and self._loop is not None
        rid = next(self._ids)
        stream = _RemoteStream(self, rid)
        admitted = self._loop.create_future()
        self._streams[rid] = stream
        self._admissions[rid] = admitted
        try:
            self._sender.send(Submit(rid, request))
        except OSError as err:
            self._streams.pop(rid, None)
            self._admissions.pop(rid, None)
            raise EngineError(ErrorCode.UNAVAILABLE, f"the engine process is gone: {err}") from err
        try:
            await admitted
        except EngineError:
            self._streams.pop(rid, None)
            raise
        except asyncio.CancelledError:
            # The caller went away while the process was admitting it: stop it there.
            self._admissions.pop(rid, None)
            self._streams.pop(rid, None)
            self._cancel(rid)
            raise
        return stream

    def _cancel(self, rid: int) -> None:
        if self._sender is None or self._failure is not None:
            return
        with contextlib.suppress(OSError):
            self._sender.send(Cancel(rid))

    def _check_open(self) -> None:
        if self._failure is not None:
            raise EngineError(ErrorCode.UNAVAILABLE, self._failure)
        if self._draining or self._closing:
            raise EngineError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        if self._sender is None:
            raise EngineError(ErrorCode.UNAVAILABLE, "the engine is not started")

    # ---- the event pipe ---------------------------------------------------------------

    def _on_readable(self) -> None:
        events = self._events
        try:
            while events.poll():
                self._dispatch(recv(events))
        except (EOFError, OSError):
            self._loop.remove_reader(events.fileno())  # type: ignore[union-attr]
            if not self._closing:
                code = self._process.poll() if self._process is not None else None
                log.error("the engine process is gone (exit code %s)", code)
            self._lost("the engine process is gone", ErrorCode.UNAVAILABLE)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Events):
            if self._on_events_delay is not None and message.sent_at:
                self._on_events_delay(max(0.0, time.monotonic() - message.sent_at))
            streams = self._streams
            for rid, event in message.items:
                stream = streams.get(rid)
                if stream is None:
                    continue  # its caller went away
                stream.put(event)
                if stream.ended:
                    del streams[rid]
        elif isinstance(message, Accepted):
            admitted = self._admissions.pop(message.rid, None)
            if admitted is None:  # the caller went away meanwhile: it was cancelled
                return
            admitted.set_result(None)
        elif isinstance(message, Refused):
            admitted = self._admissions.pop(message.rid, None)
            if admitted is not None:
                admitted.set_exception(message.error)
        elif isinstance(message, Stats):
            self._stats = message.stats
            if message.released:
                pixel_pool().released(message.released)
        else:
            log.error("unexpected message from the engine process: %r", type(message).__name__)

    def _lost(self, reason: str, code: ErrorCode) -> None:
        """Fail everything open: the process is gone (or going)."""
        if self._failure is None:
            self._failure = reason
        error = EngineError(code, reason)
        admissions, self._admissions = self._admissions, {}
        for admitted in admissions.values():
            if not admitted.done():
                admitted.set_exception(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
