"""Image prefix batches enqueued from a thread of their own, so the scheduler never waits.

Enqueueing a batch can block the thread that does it: replaying an image's tower graph while
an earlier replay of the same graph is still running (the batch's previous image of that
tiling, or the batch before) holds the launch until that replay finishes. On the scheduler's
thread this froze the steps: with 64 clients on new pictures (H100, moondream2) the scheduler
spent 57% of its time inside those replays and decode steps came once per prefix batch, about
130 ms apart. Here the scheduler hands the batch over and goes on; one launcher thread
enqueues the batches in the order they came. A batch that cannot block (the prefill lane idle,
no tiling twice in it: no replay waits behind another) is enqueued by the caller at once, as
before: a lone request does not pay the hand-over.

A `PrefixBatch` is the scheduler's handle: complete once the launcher enqueued the batch and
the batch's device event completed. A failed launch is raised in the scheduler's thread by
the next `PrefixBatch.query` (as the launch itself raised there before). Without CUDA the
batch is enqueued at once in the caller's thread: the fake device's streams are not shared
across threads, and a CPU launch blocks nothing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

# (jobs, partitioned) -> the batch's device event (`Prefill.launch`)
Launch = Callable[[list, bool], object]


class PrefixLaunchError(RuntimeError):
    """Enqueueing an image prefix batch failed on the launcher thread."""


class PrefixBatch:
    """A batch handed to the launcher: an event-like handle (``query``, ``synchronize``)."""

    def __init__(self) -> None:
        self._enqueued = threading.Event()
        self._event: object = None
        self._error: BaseException | None = None

    def settle(self, event: object, error: BaseException | None) -> None:
        """The launcher enqueued the batch (its ``event``) or failed with ``error``."""
        self._event, self._error = event, error
        self._enqueued.set()

    @property
    def enqueued(self) -> bool:
        return self._enqueued.is_set()

    def query(self) -> bool:
        """Whether the batch ran to completion on the device (no host wait)."""
        if not self._enqueued.is_set():
            return False
        if self._error is not None:
            raise PrefixLaunchError("launching an image prefix batch failed") from self._error
        return self._event.query()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        """Block the calling thread until the batch completed (or its launch failed)."""
        self._enqueued.wait()
        if self._error is None:
            # The prefix watcher's thread, never the tick: it sleeps until the batch ends.
            self._event.synchronize()  # type: ignore[attr-defined]

    def device_event(self) -> object:
        """The batch's device event, for a stream to wait on: the caller waits for the
        launcher to have enqueued it (a chained step's one host wait, behind a queue that
        is short when nothing else runs)."""
        self._enqueued.wait()
        if self._error is not None:
            raise PrefixLaunchError("launching an image prefix batch failed") from self._error
        return self._event


class PrefillLauncher:
    """Enqueues prefix batches with ``launch``, on a thread of its own when ``threaded``."""

    def __init__(self, launch: Launch, threaded: bool, device: torch.device | None = None):
        self._launch = launch
        self._device = device
        self._queue: queue.SimpleQueue[tuple[PrefixBatch, list, bool] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._handed = 0  # batches handed to the thread and not yet enqueued by it
        if threaded:
            self._thread = threading.Thread(target=self._run, name="prefill-launcher", daemon=True)
            self._thread.start()

    def submit(self, jobs: list, partitioned: bool = False, inline: bool = False) -> PrefixBatch:
        """Hand a batch over; returns its handle at once. ``inline``: the caller says the
        launch cannot block, so it runs here unless earlier batches still wait for the thread
        (the order of batches on the lane is kept)."""
        batch = PrefixBatch()
        with self._lock:
            threaded = self._thread is not None and (self._handed > 0 or not inline)
            if threaded:
                self._handed += 1
                self._queue.put((batch, jobs, partitioned))
        if not threaded:
            self._enqueue(batch, jobs, partitioned)
        return batch

    def close(self) -> None:
        """Stop the thread after the batches handed over so far."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _enqueue(self, batch: PrefixBatch, jobs: list, partitioned: bool) -> None:
        try:
            event = self._launch(jobs, partitioned)
        except BaseException as err:  # raised in the scheduler's thread by batch.query
            batch.settle(None, err)
        else:
            batch.settle(event, None)

    @torch.inference_mode()
    def _run(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current device is per thread
        while (item := self._queue.get()) is not None:
            self._enqueue(*item)
            with self._lock:
                self._handed -= 1
