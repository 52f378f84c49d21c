"""The engine in the server's own process: the asyncio `Engine` contract over a
`BatchedEngine`.

The engine's one entry (`BatchedEngine.admit`) takes each request with a route that settles
the caller's admission on its event loop and holds its events in the loop's `EventOutbox`;
the scheduler flushes that once per tick, with one ``loop.call_soon_threadsafe`` per loop for
all its events. Blocking work (graph captures, joins) runs off the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from vlm_server.engine.api import (
    Emitted,
    EngineError,
    EngineInfo,
    EngineStats,
    Event,
    GenerationRequest,
    stream_events,
)
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.intake import Ticket

# How often `drain` looks whether the engine finished what it took.
DRAIN_POLL_S = 0.01


class EventOutbox:
    """Events from the scheduler thread to event loops, handed over in batches.

    Each ``loop.call_soon_threadsafe`` writes to the loop's wake-up socket and wakes it; at 64
    streams a step emits 64 events, and one call per event cost the scheduler thread more
    than building the step. `flush` makes one call per loop for everything pushed so far.
    Used from one thread (the scheduler's).
    """

    def __init__(self) -> None:
        self._items: list[tuple[asyncio.AbstractEventLoop, Callable[[Any], None], object]] = []

    def push(
        self, loop: asyncio.AbstractEventLoop, put: Callable[[Any], None], event: object
    ) -> None:
        self._items.append((loop, put, event))

    def flush(self) -> None:
        if not self._items:
            return
        batch, self._items = self._items, []
        loop = batch[0][0]
        if all(item[0] is loop for item in batch):
            loop.call_soon_threadsafe(_deliver, batch)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for item in batch:
            by_loop.setdefault(item[0], []).append(item)
        for each, items in by_loop.items():
            each.call_soon_threadsafe(_deliver, items)


def _deliver(batch: list[tuple[object, Callable[[Any], None], object]]) -> None:
    for _, put, event in batch:
        put(event)


class InProcessStream:
    """One request's route and, once accepted, its event stream on the caller's loop;
    raises the EngineError that ended it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: EventOutbox) -> None:
        self._loop = loop
        self._outbox = outbox
        self._queue: asyncio.Queue[Emitted] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = loop.create_future()
        self.ticket: Ticket[Any] | None = None

    # ---- the route (engine/intake.py) -----------------------------------------------------

    def accepted(self) -> None:
        self._on_loop(_settle, self.admitted, None)

    def refused(self, error: EngineError) -> None:
        self._on_loop(_settle, self.admitted, error)

    def emit(self, event: Emitted) -> None:
        """Called from the scheduler thread: held until the engine flushes its events."""
        self._outbox.push(self._loop, self._queue.put_nowait, event)

    def _on_loop(self, call: Callable[..., None], *args: object) -> None:
        """``call(*args)`` now when this is the loop's thread (an admission that needed no
        other thread), else on the loop."""
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            call(*args)
        else:
            self._loop.call_soon_threadsafe(call, *args)

    # ---- the stream -----------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Event]:
        return stream_events(self._queue)

    def cancel(self) -> None:
        if self.ticket is not None:
            self.ticket.cancel()


def _settle(admitted: asyncio.Future[None], error: EngineError | None) -> None:
    if admitted.done():  # its caller went away
        return
    if error is None:
        admitted.set_result(None)
    else:
        admitted.set_exception(error)


class InProcessEngine:
    """A `BatchedEngine` serving this process's event loop (the `Engine` contract)."""

    def __init__(self, batched: BatchedEngine) -> None:
        self.batched = batched
        self.info: EngineInfo = batched.info
        self._outbox = EventOutbox()
        batched.outbox = self._outbox

    async def start(self) -> None:
        """Capture CUDA graphs (on CUDA) and start the scheduler thread, off the loop."""
        await asyncio.to_thread(self.batched.start)

    def warm_constraints(self) -> None:
        """`BatchedEngine.warm_constraints`."""
        self.batched.warm_constraints()

    def watch_events_delay(self, observe: Callable[[float], None]) -> None:
        """Nothing to observe: events reach their streams in this process."""

    async def submit(self, request: GenerationRequest) -> InProcessStream:
        """Admit ``request`` (`BatchedEngine.admit`); raises the EngineError that refused it.
        A caller cancelled while the request is decoded or built cancels it there: what a
        build took is given back once it completes."""
        stream = InProcessStream(asyncio.get_running_loop(), self._outbox)
        stream.ticket = self.batched.admit(request, stream)
        try:
            await stream.admitted
        except asyncio.CancelledError:
            stream.cancel()
            raise
        return stream

    def stats(self) -> EngineStats:
        return self.batched.stats()

    def failure(self) -> str | None:
        return self.batched.failure()

    async def drain(self, timeout: float) -> None:
        self.batched.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.batched.busy() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def close(self) -> None:
        """Stop the engine (joins its threads off the loop)."""
        await asyncio.to_thread(self.batched.close)
