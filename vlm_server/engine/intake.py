"""How a request enters the engine: decoded, built, queued, and its outcome routed.

`Intake.admit` is the engine's one entry (`BatchedEngine.admit`). It never blocks its caller
for long work: a JPEG left encoded is decoded on a decode thread (a GPU decode blocks its
thread for milliseconds), a client constraint (choices / regex) is compiled on the builder
thread (compiling one can take the constraint's whole time limit), and a request naming an
adapter is built on an adapter thread (a load or a wait for a slot). Whatever thread ends
the admission tells the request's `Route` once: accepted, or refused with the `EngineError`
that says why. Its events then go to the route from the scheduler thread.

A request cancelled before it was queued is never queued: its decode or build finishes
(a compile in progress is stopped), what the build holds is released, and the route hears
CANCELLED.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

from image_pipeline import EncodedImage
from vlm_server.engine.api import Emitted, EngineError, ErrorCode, GenerationRequest

log = logging.getLogger(__name__)

# Threads decoding the JPEGs left encoded: two keep the JPEG engines busy while one thread
# waits for its crops, and each holds a decode buffer as large as its largest picture.
IMAGE_DECODE_THREADS = 2
# Requests whose adapter is being loaded (or waits for a slot) at once; more wait their turn.
ADAPTER_THREADS = 16


class Route(Protocol):
    """Where one request's outcome goes. `accepted` or `refused` is called exactly once, on
    any thread; `emit` gets its events on the scheduler thread, possibly before `accepted`."""

    def accepted(self) -> None: ...

    def refused(self, error: EngineError) -> None: ...

    def emit(self, event: Emitted) -> None: ...


class Built(Protocol):
    """A built request (the engine's `Sequence`)."""

    def release_resources(self) -> None: ...


_S = TypeVar("_S", bound=Built)


class Admitting(Protocol[_S]):
    """What the intake needs of the engine."""

    def check_open(self) -> None:
        """Raise EngineError (UNAVAILABLE) when the engine takes no requests."""

    def decode_image(self, request: GenerationRequest) -> GenerationRequest: ...

    def build(self, request: GenerationRequest) -> _S: ...

    def queue(self, seq: _S, emit: Callable[[Emitted], None]) -> None:
        """Hand ``seq`` to the scheduler; EngineError (and ``seq`` released) if it cannot."""

    def cancel(self, seq: _S) -> None: ...

    def stop_compiling(self, request: GenerationRequest) -> None:
        """Stop compiling ``request``'s constraint, if that is under way."""


class Ticket(Generic[_S]):
    """One request from its admission on: `cancel` stops it wherever it is. Thread-safe."""

    __slots__ = ("_cancelled", "_engine", "_lock", "_seq", "request")

    def __init__(self, engine: Admitting[_S], request: GenerationRequest) -> None:
        self._engine = engine
        self.request = request
        self._lock = threading.Lock()
        self._seq: _S | None = None
        self._cancelled = False

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            seq = self._seq
        if seq is not None:
            self._engine.cancel(seq)
        else:  # still decoding or building: a constraint's compile stops now
            self._engine.stop_compiling(self.request)

    def bind(self, seq: _S) -> bool:
        """Attach the built ``seq`` (the intake's call); False when the request was
        cancelled meanwhile."""
        with self._lock:
            if self._cancelled:
                return False
            self._seq = seq
            return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


class Intake(Generic[_S]):
    """The routing of requests into one engine, and the threads it runs them on."""

    def __init__(self, engine: Admitting[_S], max_decoding: int) -> None:
        """``max_decoding``: requests whose JPEG may wait for or be in a decode at once;
        more are refused as a full queue is (the engine's queue counts them only once
        decoded)."""
        self._engine = engine
        self.max_decoding = max_decoding
        self._lock = threading.Lock()
        self._decoding = 0  # under _lock
        self._decoder = ThreadPoolExecutor(IMAGE_DECODE_THREADS, thread_name_prefix="jpeg-decode")
        # One builder thread: constraint compilation holds the compiler's lock anyway.
        self.builder = ThreadPoolExecutor(1, thread_name_prefix="request-builder")
        # Requests naming an adapter are built here: a load (file, download, a wait for a
        # slot) blocks one of these threads, not the caller nor other requests.
        self._adapter_threads = ThreadPoolExecutor(
            ADAPTER_THREADS, thread_name_prefix="adapter-load"
        )

    @property
    def decoding(self) -> int:
        """Requests whose JPEG waits for or is in a decode."""
        return self._decoding

    def admit(self, request: GenerationRequest, route: Route) -> Ticket[_S]:
        """Admit ``request``; its outcome and events go to ``route``. Returns at once (a
        request with nothing slow to do is queued, or refused, before it returns)."""
        ticket: Ticket[_S] = Ticket(self._engine, request)
        try:
            self._engine.check_open()
        except EngineError as err:
            route.refused(err)
            return ticket
        if isinstance(request.image, EncodedImage):
            with self._lock:
                full = self._decoding >= self.max_decoding
                self._decoding += not full
            if full:
                route.refused(
                    EngineError(
                        ErrorCode.RESOURCE_EXHAUSTED,
                        f"the queue is full ({self.max_decoding} images waiting to be decoded)",
                    )
                )
                return ticket
            if not _run_on(self._decoder, route, self._decode_then_build, ticket, route):
                with self._lock:
                    self._decoding -= 1
        else:
            self._route(ticket, request, route)
        return ticket

    def close(self) -> None:
        """Drop work not started; work under way finishes on its thread."""
        for pool in (self._decoder, self.builder, self._adapter_threads):
            pool.shutdown(wait=False, cancel_futures=True)

    def _decode_then_build(self, ticket: Ticket[_S], route: Route) -> None:
        request = ticket.request
        try:
            decoded = self._engine.decode_image(request)
        except Exception as err:
            route.refused(_refusal("decoding the image of", request, err))
            return
        finally:
            with self._lock:
                self._decoding -= 1
        self._route(ticket, decoded, route)

    def _route(self, ticket: Ticket[_S], request: GenerationRequest, route: Route) -> None:
        if ticket.cancelled:
            route.refused(_cancelled())
        elif request.adapter:  # may load or wait for a slot
            _run_on(self._adapter_threads, route, self._build_and_queue, ticket, request, route)
        elif request.choices or request.regex is not None:
            _run_on(self.builder, route, self._build_and_queue, ticket, request, route)
        else:
            self._build_and_queue(ticket, request, route)

    def _build_and_queue(
        self, ticket: Ticket[_S], request: GenerationRequest, route: Route
    ) -> None:
        engine = self._engine
        try:
            seq = engine.build(request)
        except Exception as err:
            route.refused(_refusal("building", request, err))
            return
        if not ticket.bind(seq):  # its caller went away while it was built
            seq.release_resources()
            route.refused(_cancelled())
            return
        try:
            engine.queue(seq, route.emit)
        except Exception as err:
            route.refused(_refusal("queueing", request, err))
            return
        route.accepted()


def _run_on(
    pool: ThreadPoolExecutor, route: Route, work: Callable[..., None], *args: object
) -> bool:
    """``work(*args)`` on ``pool``; False (and ``route`` refused) once the pool is shut
    down, as the engine closes."""
    try:
        pool.submit(work, *args)
    except RuntimeError:
        route.refused(EngineError(ErrorCode.UNAVAILABLE, "the server is shutting down"))
        return False
    return True


def _cancelled() -> EngineError:
    return EngineError(ErrorCode.CANCELLED, "the request was cancelled")


def _refusal(what: str, request: GenerationRequest, err: Exception) -> EngineError:
    """What refuses a request whose admission raised ``err``: itself if an EngineError,
    else INTERNAL (a bug: that request is refused, the engine serves on)."""
    if isinstance(err, EngineError):
        return err
    log.exception("%s request %r failed", what, request.request_id, exc_info=err)
    return EngineError(ErrorCode.INTERNAL, f"{what} the request: {err}")
