"""The batched engine: requests in, through one entry, to the scheduler thread.

`admit` is the one entry (engine/intake.py): it decodes a JPEG left encoded, builds the
request's prompt and grammar, and hands the sequence to the scheduler thread through a
lock-protected inbox, each slow step on a thread of its own; the request's `Route` hears
whether it was taken, then its events. The scheduler thread owns the model and the device;
it flushes its `Outbox` once per tick, so that events reach their readers in one hand-over
per tick. Nothing here runs an event loop: an asyncio server wraps the engine
(server/in_process.py), an engine process pipes it (engine/process/worker.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from image_pipeline import EncodedImage, ImageError, ImagePreparer
from vlm_server.engine.adapters import AdapterManager, qualify_image
from vlm_server.engine.api import (
    Emitted,
    EngineError,
    EngineInfo,
    EngineStats,
    ErrorCode,
    GenerationRequest,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.observer import NO_OBSERVER, Observer
from vlm_server.engine.core.outputs import output_for
from vlm_server.engine.core.pipeline import Step
from vlm_server.engine.core.scheduler import Scheduler
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.device.compile_clock import CompileClock
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.engine.intake import Intake, Route, Ticket
from vlm_server.engine.requests.tasks import TaskCompiler
from vlm_server.engine.segment_finisher import SegmentFinisher
from vlm_server.models.interface import LoadedModel, SegmentRefine

log = logging.getLogger(__name__)

# How long the scheduler thread sleeps when it waits for nothing but an image prefix (on
# CUDA a watcher thread wakes it when the prefix is done; this bounds a missed wake).
PREFIX_POLL_S = 0.0005
PREFIX_WATCHED_POLL_S = 0.02


class _Watcher:
    """A thread that sleeps on one device event at a time and wakes the scheduler the moment
    it completes: an image prefix ready while nothing else runs (one request alone), or a
    step whose commit waits while requests may arrive (`BatchedEngine._wait_step`)."""

    def __init__(self, wait: Callable[[object], None], done: Callable[[], None], name: str) -> None:
        self._wait, self._done = wait, done
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._watched: object = None  # scheduler thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, key: object, handle: object) -> None:
        """Wake the scheduler once ``handle`` completes (``key`` names what is waited for: a
        handle is reused by later batches and steps)."""
        if key is not self._watched:
            self._watched = key
            self._queue.put(handle)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (handle := self._queue.get()) is not None:
            try:
                self._wait(handle)
            except Exception:  # a device error: the scheduler thread meets it too
                log.exception("waiting for the device failed")
            finally:
                self._done()


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class Outbox(Protocol):
    """Where the scheduler thread's events wait until it flushes them, once per tick."""

    def flush(self) -> None: ...


class DirectOutbox:
    """Events go straight to their route's `emit`: nothing waits for a flush."""

    def flush(self) -> None:
        pass


def _release_both(first: Callable[[], None], unpin: Callable[[int], None], slot: int) -> None:
    """A request's constraint rows, then its adapter slot's pin."""
    try:
        first()
    finally:
        unpin(slot)


class BatchedEngine:
    """Continuous batching over a paged KV cache with a two-slot pipeline."""

    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig | None = None,
        preset_name: str | None = None,
        observer: Observer = NO_OBSERVER,
        image_preparer: ImagePreparer | None = None,
        segment_refiner: SegmentRefine | None = None,
    ) -> None:
        """``image_preparer`` makes the crops of host-decoded images (`HostImage`) a request
        brings (default: the reference's resize on the model's device). ``segment_refiner``:
        the model family's, run on each segment's answer before its final event
        (engine/segment_finisher.py)."""
        self.loaded = loaded
        self.cfg = cfg or EngineConfig()
        self.observer = observer
        model = loaded.model
        mc = model.config
        contract = self.contract = mc.tokens
        self.info = EngineInfo(
            model_name=mc.name,
            preset=preset_name or mc.name,
            token_contract=contract.name,
            device=str(model.device),
            dtype=_DTYPE_NAMES.get(model.dtype, str(model.dtype)),
            pipeline_depth=self.cfg.pipeline_depth,
            max_batch_size=self.cfg.max_batch_size,
            max_context=mc.text.max_context,
            max_queue=self.cfg.max_queue,
            max_step_tokens=self.cfg.max_step_tokens,
            max_choices=self.cfg.constraint_limits.max_choices,
            max_choice_chars=self.cfg.constraint_limits.max_choice_chars,
            max_regex_chars=self.cfg.constraint_limits.max_regex_chars,
            max_spatial_refs=self.cfg.max_spatial_refs,
        )
        self.tasks = TaskCompiler(
            mc,
            loaded.tokenizer,
            self.cfg.mask_table_rows,
            self.cfg.constraint_limits,
            compile_in_child=True,
            max_spatial_refs=self.cfg.max_spatial_refs,
        )
        self.table = self.tasks.table
        # What the scheduler flushes once per tick: where the routes' `emit` hold events
        # (an event loop's hand-over, an engine process's pipe). Replaceable before `start`.
        self.outbox: Outbox = DirectOutbox()
        self.runtime = ModelRuntime(
            model, self.cfg, self.table, observer=observer, image_preparer=image_preparer
        )
        self.scheduler = Scheduler(
            self.runtime,
            self.cfg,
            contract.eos_id,
            mc.image_prefix_len,
            observer=observer,
            flush_events=self._flush_events,
        )
        self._inbox: list[Sequence] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._failure: BaseException | None = None
        self._prefix_done = False  # set by the prefix watcher, under _cv
        self._segments_done = False  # set by the segment finisher's worker, under _cv
        self.segments = SegmentFinisher(
            segment_refiner, self.runtime.image_preparer, self._on_segments_done, model.device
        )
        self.scheduler.finish_later = self.segments.submit
        self._prefix_watcher: _Watcher | None = None
        self._step_watcher: _Watcher | None = None
        self._step_done = False  # set by the step watcher, under _cv
        if self.runtime.dev.is_cuda:
            self._prefix_watcher = _Watcher(
                self.runtime.wait_prefix, self._on_prefix_done, "prefix-watcher"
            )
            if self.runtime.interactive_prefix_slots:
                self._step_watcher = _Watcher(
                    self.runtime.wait_outputs, self._on_step_done, "step-watcher"
                )
                self.scheduler.step_wait = self._wait_step
        self.intake: Intake[Sequence] = Intake(self, max_decoding=self.cfg.max_queue)
        # Finetune adapters (engine/adapters.py), when the config and the family take them.
        bank = self.runtime.adapter_bank
        self.adapters = AdapterManager(self.cfg, bank) if bank is not None else None
        if bank is not None:
            self.info = dataclasses.replace(
                self.info, max_adapters=bank.n_slots, max_adapter_rank=bank.max_rank
            )

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Capture CUDA graphs (on CUDA), then start the scheduler thread. Blocks for the
        captures."""
        rt = self.runtime
        if self.cfg.cuda_graphs and rt.dev.is_cuda and not rt.steps.decode_graphs:
            started = time.perf_counter()
            with CompileClock() as compiles:
                rt.capture_graphs()
                rt.capture_vision_graphs()
            took = time.perf_counter() - started
            log.info("graphs captured in %.1f s; %s", took, compiles.line())
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
            self._thread.start()

    def warm_constraints(self) -> None:
        """Start the constraint compiler's child process in the background, so that the
        first constrained request does not wait for it (servers call this once ready)."""
        self.intake.builder.submit(self.tasks.constraints.warm)

    def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE) from now on; those taken run on (`busy`)."""
        self._draining = True

    def busy(self) -> bool:
        """Whether a taken request has not finished yet."""
        with self._cv:
            return bool(self._inbox) or self.scheduler.has_work()

    def close(self) -> None:
        """Stop the scheduler thread once its device work is done, then everything else.
        Blocks for the joins."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for watcher in (self._prefix_watcher, self._step_watcher):
            if watcher is not None:
                watcher.close()
        self.runtime.close()  # joins the prefill launcher
        self.intake.close()
        self.tasks.constraints.close()
        self.observer.closed()

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()  # plain counters: a racy read is fine for metrics
        stats.queue_depth += len(self._inbox)
        stats.images_decoding = self.intake.decoding
        if self.adapters is not None:
            stats.adapters = tuple(self.adapters.loaded())
        return stats

    def failure(self) -> str | None:
        return None if self._failure is None else f"the engine failed: {self._failure}"

    def idle(self) -> bool:
        """Every page free (cached image prefixes aside), every slot and row unused."""
        with self._cv:
            s = self.scheduler
            return (
                not self._inbox
                and not s.has_work()
                and not s.zombies
                and not self.segments.pending()
                and len(s.free_rows) == self.cfg.max_rows
                and all(x is None for x in s.pipe.slots)
            )

    # ---- submission -------------------------------------------------------------------

    def admit(self, request: GenerationRequest, route: Route) -> Ticket[Sequence]:
        """The one entry: take ``request``, whose outcome (accepted, or refused with an
        EngineError) and then events go to ``route`` (engine/intake.py). Returns at once,
        with what cancels the request; thread-safe."""
        return self.intake.admit(request, route)

    def queue(self, seq: Sequence, emit: Callable[[Emitted], None]) -> None:
        """Queue a built sequence whose events go to ``emit`` (called on the scheduler
        thread); raises EngineError when it cannot be taken, and then releases it.
        Thread-safe."""
        try:
            self._enqueue(seq, emit)
        except BaseException:
            seq.release_resources()  # refused: nothing in flight ever saw its rows
            raise

    def _enqueue(self, seq: Sequence, emit: Callable[[Emitted], None]) -> None:
        self.check_open()
        scheduler = self.scheduler
        total_pages = scheduler.pages.n_pages - 1
        need = scheduler.worst_case_pages(seq)
        if need > total_pages:
            raise EngineError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the request needs {need} KV pages but the cache has "
                f"{total_pages}; lower max_tokens / max_objects",
                "max_tokens",
            )
        seq.emit = emit
        with self._cv:
            if len(self._inbox) + len(scheduler.waiting) >= self.cfg.max_queue:
                raise EngineError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"the queue is full ({self.cfg.max_queue} waiting requests)",
                )
            self._inbox.append(seq)
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` (a no-op once it ended); thread-safe."""
        if seq.cancelled is None and not seq.finished:
            seq.cancelled = ErrorCode.CANCELLED
            self._wake()

    def check_open(self) -> None:
        """Raise EngineError (UNAVAILABLE) when the engine takes no more requests."""
        if self._draining or self._stopping:
            raise EngineError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        if self._failure is not None:
            raise EngineError(ErrorCode.UNAVAILABLE, f"the engine failed: {self._failure}")

    def stop_compiling(self, request: GenerationRequest) -> None:
        """Stop compiling ``request``'s constraint, if a child is doing so (its caller went
        away)."""
        if request.choices or request.regex is not None:
            self.tasks.constraints.cancel(request.choices, request.regex)

    def decode_image(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with a JPEG left encoded (`EncodedImage`) decoded and cropped on this
        engine's image device, unless its image prefix is cached already (then nothing
        reads its pixels). Blocks for the decode: the intake calls it on a thread of its
        own. Raises EngineError (INVALID_ARGUMENT, field ``image``) for data the
        decoders refuse."""
        req = qualify_image(req)  # an adapter's prefixes are cached apart
        image = req.image
        if not isinstance(image, EncodedImage):
            return req
        # A racy read of the scheduler's cache (a dict lookup): if the entry goes before
        # the request runs, the runtime decodes it then (`ImageCrops.crops_of`).
        if self.scheduler.prefix_cache.peek(image.content_hash) is not None:
            return req
        try:
            prepared = self.runtime.image_preparer.prepare_encoded(image)
        except ImageError as err:
            # The server checked the header; what fails here is the body, first read now.
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT, f"image: {err.reason.value}: {err.message}", "image"
            ) from None
        return dataclasses.replace(req, image=prepared)

    def build(self, req: GenerationRequest) -> Sequence:
        """The request's sequence: prompt and grammar from the shared task definitions.
        Raises EngineError for a request the task definitions refuse. A request naming an
        adapter blocks until the adapter holds a slot (`AdapterManager.acquire`)."""
        if req.adapter and self.adapters is None:
            raise EngineError(
                ErrorCode.INVALID_ARGUMENT,
                "adapter: this server serves no adapters (it needs --adapters-dir or "
                "--adapter-endpoint, and a model family with adapter targets)",
                "adapter",
            )
        req = qualify_image(req)
        built = self.tasks.build(req)
        release, slot = built.release, -1
        if req.adapter and self.adapters is not None:
            try:
                slot = self.adapters.acquire(req.adapter, req.deadline)
            except BaseException:
                built.release()
                raise
            release = partial(_release_both, built.release, self.adapters.release, slot)
        seq = Sequence(
            request=req,
            prompt=built.prompt,
            grammar=built.grammar,
            prefix_len=built.prefix_len,
            output=output_for(built.grammar, self.tasks.vocab),
            on_release=release,
            ref_values=built.ref_values,
        )
        seq.adapter_slot = slot
        return seq

    # ---- the scheduler thread ----------------------------------------------------------

    def _flush_events(self) -> None:
        self.outbox.flush()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _on_segments_done(self) -> None:
        with self._cv:
            self._segments_done = True
            self._cv.notify()

    def _deliver_segments(self, finish: bool = False) -> None:
        """Send the finished segments' final events (``finish``: wait for every one first)."""
        stage = self.segments
        if finish:
            stage.close()
        for emit, event in stage.take():
            emit(event)
        self.outbox.flush()

    def _on_prefix_done(self) -> None:
        with self._cv:
            self._prefix_done = True
            self._cv.notify()

    def _on_step_done(self) -> None:
        with self._cv:
            self._step_done = True
            self._cv.notify()

    def _wait_step(self, step: Step[Sequence]) -> bool:
        """The scheduler's wait for ``step``'s results (scheduler.step_wait), cut short by
        new requests: True once they landed; False after moving the arrivals into the queue."""
        assert self._step_watcher is not None
        self._step_watcher.watch(step, step.slot)
        with self._cv:
            while not self._step_done and not self._inbox:
                self._cv.wait()
            if self._step_done:
                self._step_done = False
                return True
            arrived, self._inbox = self._inbox, []
        self.scheduler.waiting.extend(arrived)
        return False

    def _run(self) -> None:
        s = self.scheduler
        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while (
                            not self._stopping
                            and not self._inbox
                            and not s.has_work()
                            and not self._segments_done
                        ):
                            self._cv.wait()
                        # Stop once no device work is left in flight: steps, and image
                        # prefixes still writing pages on the prefill stream.
                        if self._stopping and not s.pipe.n_in_flight and not s.pending_prefixes:
                            break
                        arrived, self._inbox = self._inbox, []
                        segments, self._segments_done = self._segments_done, False
                    if segments:
                        self._deliver_segments()
                    # The tick runs without the lock: `admit` never waits for device work.
                    s.waiting.extend(arrived)
                    s.tick()
                    if s.stalled_on_prefixes():
                        # Only an image prefix is running: sleep instead of spinning (a new
                        # request, or the watcher once the prefix is done, wakes the loop).
                        watcher = self._prefix_watcher
                        if watcher is not None:
                            oldest = s.pending_prefixes[0]
                            watcher.watch(oldest, oldest.pending)
                        nap = PREFIX_POLL_S if watcher is None else PREFIX_WATCHED_POLL_S
                        with self._cv:
                            if not self._inbox and not self._stopping and not self._prefix_done:
                                self._cv.wait(timeout=nap)
                            self._prefix_done = False
            self._deliver_segments(finish=True)  # stopping: the last segments' answers
        except BaseException as err:  # a bug or a device failure: fail every request loudly
            log.exception("scheduler thread failed")
            self._failure = err
            with self._cv:
                pending = list(s.waiting) + list(s.running) + self._inbox
            for seq in pending:
                if seq.emit is not None and not seq.finished:
                    seq.emit(EngineError(ErrorCode.INTERNAL, f"engine failure: {err}"))
            self.outbox.flush()
            # Finished answers still with the segment finisher: theirs are complete.
            self._deliver_segments(finish=True)
