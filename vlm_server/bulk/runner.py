"""Driving a batch: lines in, results out, as many in flight as the engine takes.

`run_batch` skips every line whose ``custom_id`` the results file holds already, runs the rest
with at most ``concurrency`` in flight, writes each result as it ends (in the order they end),
and reports progress. A line the engine refuses for now (its queue full: 429) waits and runs
again; a refusal because the server stops (503) ends the batch with that line unwritten, to
run at the next start. ``stop`` ends it early: no new line starts, and the lines in flight
finish (``finish_in_flight``) or are cancelled (their results unwritten: the next run does
them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

from vlm_server.bulk import lines
from vlm_server.bulk.executor import LineRunner
from vlm_server.bulk.lines import BatchRequest, LineError
from vlm_server.bulk.results import ResultLog

RETRY_AFTER_S = 0.05  # a line refused with a full queue tries again after this
STOPPING_STATUS = 503


@dataclass
class Progress:
    """How far a batch is: counts since this run began (``skipped``: done by an earlier run)."""

    total: int | None = None  # lines in the input, when known
    skipped: int = 0
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    interrupted: bool = False  # ended before every line was done (stop, or the server stops)

    @property
    def done(self) -> int:
        return self.skipped + self.completed + self.failed

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def rate(self) -> float:
        """Lines a second this run."""
        return (self.completed + self.failed) / max(self.elapsed_s, 1e-9)

    def eta_s(self) -> float | None:
        if self.total is None or not (self.completed + self.failed):
            return None
        return max(0, self.total - self.done) / max(self.rate(), 1e-9)


Item = BatchRequest | tuple[str, LineError]  # a checked line, or (custom_id, why it is bad)
OnProgress = Callable[[Progress], None]


def output_tokens(body: Any) -> int:
    """Tokens an answer generated (the Moondream routes' metrics, or OpenAI's usage)."""
    if not isinstance(body, dict):
        return 0
    for key, name in (("metrics", "output_tokens"), ("usage", "completion_tokens")):
        part = body.get(key)
        if isinstance(part, dict) and isinstance(part.get(name), int):
            return part[name]
    return 0


async def run_batch(
    items: AsyncIterable[Item],
    runner: LineRunner,
    log: ResultLog,
    concurrency: int,
    progress: Progress | None = None,
    on_progress: OnProgress | None = None,
    stop: asyncio.Event | None = None,
    finish_in_flight: bool = False,
) -> Progress:
    """Run every line of ``items`` not in ``log`` yet (``log`` open); see the module."""
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    state = progress or Progress()
    stop = stop or asyncio.Event()
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()
    stopping = asyncio.Event()  # the server refused a line: it stops

    def report() -> None:
        if on_progress is not None:
            on_progress(state)

    async def one(line: BatchRequest) -> None:
        try:
            while True:
                status, body, rid = await runner.run(line)
                if status == 429 and not stop.is_set():
                    await asyncio.sleep(RETRY_AFTER_S)
                    continue
                break
            if status == STOPPING_STATUS or (status == 429 and stop.is_set()):
                stopping.set()  # unwritten: the next run does it
                return
            if log.write(lines.answered(line.custom_id, status, body, rid)):
                if 200 <= status < 300:
                    state.completed += 1
                    state.output_tokens += output_tokens(body)
                else:
                    state.failed += 1
            report()
        finally:
            slots.release()

    async with contextlib.aclosing(_aiter(items)) as source:
        async for item in source:
            if stop.is_set() or stopping.is_set():
                break
            custom_id = item.custom_id if isinstance(item, BatchRequest) else item[0]
            if custom_id in log.done:
                state.skipped += 1
                continue
            if not isinstance(item, BatchRequest):
                if log.write(lines.failed(custom_id, item[1])):
                    state.failed += 1
                    report()
                continue
            await _acquire(slots, stop, stopping)
            if stop.is_set() or stopping.is_set():
                break
            task = asyncio.create_task(one(item))
            running.add(task)
            task.add_done_callback(running.discard)
    if running and (stop.is_set() and not finish_in_flight):
        for task in running:
            task.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)
    state.interrupted = stop.is_set() or stopping.is_set()
    report()
    return state


async def _aiter(items: AsyncIterable[Item]) -> Any:
    async for item in items:
        yield item


async def _acquire(slots: asyncio.Semaphore, *events: asyncio.Event) -> None:
    """Take a slot, or return early once any of ``events`` is set."""
    take = asyncio.ensure_future(slots.acquire())
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait([take, *waits], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if not take.done():
        take.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await take
    elif any(e.is_set() for e in events):
        slots.release()  # taken, but not used
