"""The engine process: a batched engine behind two pipes.

Its main thread reads commands; submissions with a client constraint are built on a thread
of their own (compiling one can take the constraint's whole time limit), and JPEGs the
server left encoded are decoded on threads of their own (a GPU decode blocks its caller for
milliseconds); the scheduler thread sends each tick's events up in one message. Nothing
here serves a client: that is the server process's job, so the scheduler shares its
interpreter with nothing busy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TypeVar

from image_pipeline import EncodedImage
from vlm_server.engine.api import (
    EngineError,
    EngineStats,
    ErrorCode,
    Finished,
    GenerationRequest,
)
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.engine import BatchedEngine
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

_T = TypeVar("_T")

# How often the engine's counters go up to the server (its metrics read the latest).
STATS_INTERVAL_S = 0.25

# Threads decoding the JPEGs the server left encoded: two keep the JPEG engines busy while
# one thread waits for its crops, and each holds a decode buffer as large as its largest
# picture.
IMAGE_DECODE_THREADS = 2


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


class EngineHost:
    """Serves one engine's commands from a pipe until told to close (or the server is gone)."""

    def __init__(
        self,
        engine: BatchedEngine,
        sender: Sender,
        outbox: PipeOutbox,
        gc_pauses: GcPauseCounter | None = None,
        max_decoding: int = 256,
    ) -> None:
        """``max_decoding``: requests whose JPEG may wait for or be in a decode at once;
        more are refused as a full queue is (the engine's queue counts them only once
        decoded)."""
        self.engine = engine
        self.sender = sender
        self.outbox = outbox
        self.gc_pauses = gc_pauses
        self._lock = threading.Lock()
        # Requests being built or running; None while being built.
        self._live: dict[int, Sequence | None] = {}
        self._cancel_when_built: set[int] = set()
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="constraint-builder")
        self._decoder = ThreadPoolExecutor(IMAGE_DECODE_THREADS, thread_name_prefix="jpeg-decode")
        self.max_decoding = max_decoding
        self._decoding = 0  # under _lock

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
                        self._refuse(message.rid, error)
            now = time.monotonic()
            if now >= next_stats:
                self.sender.send(Stats(self._stats(), take_released()))
                next_stats = now + STATS_INTERVAL_S
            if housekeeping is not None and housekeeping_interval > 0 and now >= next_housekeeping:
                housekeeping()
                next_housekeeping = now + housekeeping_interval
        self._builder.shutdown(wait=False, cancel_futures=True)
        self._decoder.shutdown(wait=False, cancel_futures=True)
        asyncio.run(self.engine.close())

    def _stats(self) -> EngineStats:
        stats = dataclasses.replace(self.engine.stats(), images_decoding=self._decoding)
        if self.gc_pauses is not None:
            stats = dataclasses.replace(stats, gc_pauses=self.gc_pauses.totals())
        return stats

    def _handle(self, message: object) -> None:
        if isinstance(message, Submit):
            request = message.request
            with self._lock:
                self._live[message.rid] = None
            if isinstance(request.image, EncodedImage):
                with self._lock:
                    full = self._decoding >= self.max_decoding
                    self._decoding += not full
                if full:
                    self._refuse(
                        message.rid,
                        EngineError(
                            ErrorCode.RESOURCE_EXHAUSTED,
                            f"the queue is full ({self.max_decoding} images waiting to be decoded)",
                        ),
                    )
                    return
                self._decoder.submit(self._decode_then_admit, message.rid, request)
            else:
                self._route(message.rid, request)
        elif isinstance(message, Cancel):
            with self._lock:
                if message.rid not in self._live:
                    return  # ended already
                seq = self._live[message.rid]
                if seq is None:
                    self._cancel_when_built.add(message.rid)
                    return
            self.engine.cancel(seq)
        else:
            log.error("unknown command %r", type(message).__name__)

    def _decode_then_admit(self, rid: int, request: GenerationRequest) -> None:
        """Decode the request's encoded JPEG (`BatchedEngine.decode_image`), then admit it;
        a cancel meanwhile is honoured once it is built, as for a constraint."""
        try:
            decoded = self._guarded(rid, "decoding the image of", self.engine.decode_image, request)
        finally:
            with self._lock:
                self._decoding -= 1
        if decoded is not None:
            self._route(rid, decoded)

    def _route(self, rid: int, request: GenerationRequest) -> None:
        """Admit ``request``: on the builder thread when it brings a constraint to compile."""
        if request.adapter:  # may load or wait for a slot: on the engine's adapter threads
            self.engine.adapter_threads.submit(self._admit, rid, request)
        elif request.choices or request.regex is not None:
            self._builder.submit(self._admit, rid, request)
        else:
            self._admit(rid, request)

    def _admit(self, rid: int, request: GenerationRequest) -> None:
        seq = self._guarded(rid, "building", self._enqueue, rid, request)
        if seq is None:
            return
        with self._lock:
            cancel = rid in self._cancel_when_built
            self._cancel_when_built.discard(rid)
        self.sender.send(Accepted(rid))
        if cancel:
            self.engine.cancel(seq)

    def _enqueue(self, rid: int, request: GenerationRequest) -> Sequence:
        seq = self.engine.build(request)
        with self._lock:
            self._live[rid] = seq
        self.engine.admit(seq, self.outbox.emitter(rid, self._ended))
        return seq

    def _guarded(self, rid: int, what: str, work: Callable[..., _T], *args: object) -> _T | None:
        """``work(*args)``, or None once request ``rid`` is refused for the EngineError it
        raised, or as INTERNAL for any other (a bug: refuse that request, keep serving)."""
        try:
            return work(*args)
        except EngineError as err:
            self._refuse(rid, err)
        except Exception as err:
            log.exception("%s request %d failed", what, rid)
            self._refuse(rid, EngineError(ErrorCode.INTERNAL, f"{what} the request: {err}"))
        return None

    def _refuse(self, rid: int, err: EngineError) -> None:
        with self._lock:
            self._live.pop(rid, None)
            self._cancel_when_built.discard(rid)
        self.sender.send(Refused(rid, err))

    def _ended(self, rid: int) -> None:
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
        asyncio.run(engine.start())
    except BaseException as err:  # report, then exit: the server refuses to serve
        log.exception("the engine failed to start")
        sender.send(StartFailed(f"{type(err).__name__}: {err}"))
        return
    if on_ready is not None:
        on_ready()
    sender.send(Ready(engine.info))
    warm = getattr(engine, "warm_constraints", None)  # the constraint compiler's child
    if warm is not None:
        warm()
    host = EngineHost(engine, sender, outbox, gc_pauses, max_decoding=engine.cfg.max_queue)
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
