"""The engine process: a batched engine behind two pipes.

Its main thread reads commands and hands each submission to the engine's one entry
(`BatchedEngine.admit`, which decodes, builds and queues it on threads of its own), with a
route that answers `Accepted` or `Refused` up the pipe and collects its events; the
scheduler thread sends each tick's events up in one message. Nothing here serves a client:
that is the server process's job, so the scheduler shares its interpreter with nothing busy.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from vlm_server.engine.api import Emitted, EngineError, EngineStats, ErrorCode, Finished
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.intake import Ticket
from vlm_server.engine.process.shared_pixels import take_released
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
from vlm_server.gc_pauses import GcPauseCounter

log = logging.getLogger(__name__)

# How often the engine's counters go up to the server (its metrics read the latest).
STATS_INTERVAL_S = 0.25


class PipeOutbox:
    """Collects the scheduler thread's events and sends them up once per tick."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self._items: list[tuple[int, object]] = []

    def emitter(self, rid: int, on_end: Callable[[int], None]) -> Callable[[object], None]:
        """What a sequence's events go to; ``on_end`` hears of its final one."""

        def emit(event: object) -> None:
            self._items.append((rid, event))
            if isinstance(event, Finished | EngineError):
                on_end(rid)

        return emit

    def flush(self) -> None:
        if not self._items:
            return
        batch, self._items = self._items, []
        # Blocks only while the server is a whole pipe's worth of events behind: backpressure.
        self._sender.send(Events(batch, time.monotonic()))  # type: ignore[arg-type]


class _PipeRoute:
    """One request's route (engine/intake.py): its answer up the pipe, its events into the
    outbox."""

    __slots__ = ("_host", "emit", "rid")

    def __init__(self, host: EngineHost, rid: int) -> None:
        self._host = host
        self.rid = rid
        self.emit: Callable[[Emitted], None] = host.outbox.emitter(rid, host.forget)

    def accepted(self) -> None:
        self._host.sender.send(Accepted(self.rid))

    def refused(self, error: EngineError) -> None:
        self._host.forget(self.rid)
        self._host.sender.send(Refused(self.rid, error))


class EngineHost:
    """Serves one engine's commands from a pipe until told to close (or the server is gone)."""

    def __init__(
        self,
        engine: BatchedEngine,
        sender: Sender,
        outbox: PipeOutbox,
        gc_pauses: GcPauseCounter | None = None,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.outbox = outbox
        self.gc_pauses = gc_pauses
        self._lock = threading.Lock()
        # Requests admitted and not ended: what cancels each (None: being admitted now).
        self._live: dict[int, Ticket[Any] | None] = {}

    def serve(
        self,
        commands: Connection,
        fd_socket: socket.socket | None = None,
        housekeeping: Callable[[], None] | None = None,
        housekeeping_interval: float = 0.0,
    ) -> None:
        now = time.monotonic()
        next_stats = now + STATS_INTERVAL_S
        next_housekeeping = now + housekeeping_interval
        while True:
            if commands.poll(max(0.0, next_stats - time.monotonic())):
                try:
                    message = recv(commands, fd_socket)
                except (EOFError, ConnectionError):
                    log.warning("the server is gone: stopping the engine")
                    break
                except Exception:  # one unreadable message: the others still get served
                    log.exception("cannot read a command")
                    continue
                if isinstance(message, Close):
                    break
                try:
                    self._handle(message)
                except Exception as err:  # a bug: refuse that request, keep serving
                    log.exception("command %s failed", type(message).__name__)
                    if isinstance(message, Submit):
                        error = EngineError(ErrorCode.INTERNAL, f"admitting the request: {err}")
                        _PipeRoute(self, message.rid).refused(error)
            now = time.monotonic()
            if now >= next_stats:
                self.sender.send(Stats(self._stats(), take_released()))
                next_stats = now + STATS_INTERVAL_S
            if housekeeping is not None and housekeeping_interval > 0 and now >= next_housekeeping:
                housekeeping()
                next_housekeeping = now + housekeeping_interval
        self.engine.close()

    def _stats(self) -> EngineStats:
        stats = self.engine.stats()
        if self.gc_pauses is not None:
            stats = dataclasses.replace(stats, gc_pauses=self.gc_pauses.totals())
        return stats

    def _handle(self, message: object) -> None:
        if isinstance(message, Submit):
            rid = message.rid
            with self._lock:
                self._live[rid] = None
            ticket = self.engine.admit(message.request, _PipeRoute(self, rid))
            with self._lock:
                if rid in self._live:  # else it ended already
                    self._live[rid] = ticket
        elif isinstance(message, Cancel):
            with self._lock:
                ticket = self._live.get(message.rid)
            if ticket is not None:  # else it ended already
                ticket.cancel()
        else:
            log.error("unknown command %r", type(message).__name__)

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended (or was refused): nothing cancels it any more."""
        with self._lock:
            self._live.pop(rid, None)


def run_engine_process(
    factory: Callable[[], BatchedEngine],
    commands: Connection,
    fd_socket: socket.socket | None,
    events: Connection,
    setup: Callable[[], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    housekeeping: Callable[[], None] | None = None,
    housekeeping_interval: float = 0.0,
) -> None:
    """The engine process's entry point: ``setup`` (logging, allocator), build and start the
    engine, say `Ready` (or `StartFailed`), then serve commands until `Close`."""
    if setup is not None:
        setup()
    gc_pauses = GcPauseCounter()
    gc_pauses.install()
    sender = Sender(events, plain=True)
    try:
        engine = factory()
        outbox = PipeOutbox(sender)
        engine.outbox = outbox
        engine.start()
    except BaseException as err:  # report, then exit: the server refuses to serve
        log.exception("the engine failed to start")
        sender.send(StartFailed(f"{type(err).__name__}: {err}"))
        return
    if on_ready is not None:
        on_ready()
    sender.send(Ready(engine.info))
    engine.warm_constraints()  # the constraint compiler's child
    host = EngineHost(engine, sender, outbox, gc_pauses)
    host.serve(commands, fd_socket, housekeeping, housekeeping_interval)


def main(argv: list[str]) -> int:
    """``python -m vlm_server.engine.process.worker COMMANDS_FD FD_SOCKET EVENTS_FD``, with the
    pickled ``(factory, setup, on_ready, housekeeping, housekeeping_interval)`` on stdin."""
    # The server decides when this process ends (Close, or the end of its pipe): a signal
    # sent to the whole group (Ctrl-C in a terminal, a service manager's SIGTERM) must not
    # kill the engine under the requests the server is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    factory, setup, on_ready, housekeeping, interval = pickle.load(sys.stdin.buffer)
    commands = Connection(int(argv[0]), writable=False)
    fd_socket = socket.socket(fileno=int(argv[1]))
    events = Connection(int(argv[2]), readable=False)
    run_engine_process(
        factory, commands, fd_socket, events, setup, on_ready, housekeeping, interval
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
