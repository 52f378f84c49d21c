"""`Engine` on top of the reference generator: one worker thread, one request at a time.

It is the simplest correct engine: the gRPC service runs on it until the batched engine
arrives, and its greedy output is by construction the reference output. The worker thread owns
the model; `submit` (on the event loop) only validates and enqueues. Events cross back with
``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``.

Checks: the queue limit and the context length at submit; the deadline when a request is
dequeued (and by a timer while it waits) and, for text, between tokens; cancellation between
tokens. Point and detect run to completion once started (the reference loop has no per-step
hook; both are short). Not supported here, answered with UNIMPLEMENTED: segment, and the
choices / regex answer constraints (they are validated first, so bad input still gets
INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from decoding.detokenize import StreamDetokenizer
from decoding.regex_dfa import parse_regex
from decoding.vocab import TokenVocab
from vlm_server import prompts
from vlm_server.engine.api import (
    Box,
    EngineError,
    EngineInfo,
    EngineStats,
    ErrorCode,
    Event,
    Finished,
    GenerationRequest,
    Point,
    RequestMetrics,
    Task,
    TextDelta,
)
from vlm_server.reference import ContextOverflow, ReferenceGenerator, SamplingSettings
from vlm_server.weights.loader import LoadedModel

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_POSITIONS_PER_OBJECT = {Task.POINT: 2, Task.DETECT: 3}


def _check_regex(pattern: str) -> None:
    # Syntax only (linear in the pattern, on the event loop): this engine refuses
    # constrained queries anyway, so building the automaton would be unbounded work for nothing.
    parse_regex(pattern)


class _Stream:
    """The consumer side of one request: an async iterator over its events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: Callable[[], None]) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event | EngineError] = asyncio.Queue()
        self._cancel = cancel

    def push(self, item: Event | EngineError) -> None:
        """Deliver an event from any thread."""
        # A closed loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            item = await self._queue.get()
            if isinstance(item, EngineError):
                raise item
            yield item
            if isinstance(item, Finished):
                return

    def cancel(self) -> None:
        self._cancel()


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    prompt: list[int]
    stream: _Stream
    admitted: float  # time.monotonic()
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline_timer: asyncio.TimerHandle | None = None


class _DeadlineExceeded(Exception):
    pass


class ReferenceEngine:
    """Serves requests with `ReferenceGenerator` on a single worker thread.

    ``load`` runs on the worker thread at `start` and returns the model; ``max_queue`` bounds
    the requests waiting behind the running one; ``kv_budget_bytes`` (0 = no limit beyond the
    context) bounds the KV cache one request may need.
    """

    def __init__(
        self, load: Callable[[], LoadedModel], *, max_queue: int = 64, kv_budget_bytes: int = 0
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self._load = load
        self._max_queue = max_queue
        self._kv_budget_bytes = kv_budget_bytes
        self._kv_bytes_per_position = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._info: EngineInfo | None = None
        self._generator: ReferenceGenerator | None = None
        self._vocab: TokenVocab | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._closed = False
        self._draining = False
        self._idle: asyncio.Event | None = None
        self._last_step_ms = 0.0
        self._counts = collections.Counter[str]()

    # ---- Engine protocol ----------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the engine has not started")
        return self._info

    async def start(self) -> None:
        """Load the model on the worker thread; returns when requests can be taken."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        loaded: asyncio.Future[None] = self._loop.create_future()
        # Daemon: a process asked to exit must not hang on a model still loading.
        self._thread = threading.Thread(
            target=self._main, args=(loaded,), daemon=True, name="reference-engine"
        )
        self._thread.start()
        await loaded

    async def submit(self, request: GenerationRequest) -> _Stream:
        """Validate and enqueue; raises EngineError when the request cannot be taken."""
        if self._loop is None or self._generator is None:
            raise EngineError(ErrorCode.UNAVAILABLE, "the engine is not started")
        if self._draining or self._closed:
            raise EngineError(ErrorCode.UNAVAILABLE, "the server is draining; retry elsewhere")
        prompt = self._validate(request)
        job: _Job
        stream = _Stream(self._loop, lambda: self._cancel(job))
        job = _Job(request, prompt, stream, time.monotonic())
        with self._cond:
            if len(self._waiting) >= self._max_queue:
                self._counts["rejected_queue_full"] += 1
                raise EngineError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"the request queue is full ({self._max_queue} waiting)",
                )
            self._waiting.append(job)
            self._counts["admitted"] += 1
            self._cond.notify()
        assert self._idle is not None
        self._idle.clear()
        if request.deadline is not None:
            job.deadline_timer = self._loop.call_later(
                max(0.0, request.deadline - time.monotonic()), self._expire_waiting, job
            )
        return stream

    def stats(self) -> EngineStats:
        with self._cond:
            running = self._running is not None
            return EngineStats(
                queue_depth=len(self._waiting),
                active_sequences=int(running),
                last_batch_size=int(running),
                last_step_ms=self._last_step_ms,
            )

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, then wait (up to ``timeout`` s) for accepted ones to finish."""
        self._draining = True
        if self._idle is None:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.warning("drain: requests still running after %.1f s", timeout)

    async def close(self) -> None:
        """Fail whatever is left with UNAVAILABLE and stop the worker thread."""
        with self._cond:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            if self._running is not None:
                self._running.cancelled.set()
            self._cond.notify_all()
        for job in left:
            job.stream.push(
                EngineError(ErrorCode.UNAVAILABLE, "the server shut down before the request ran")
            )
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ---- extras (not part of the protocol) ----------------------------------------------

    def counts(self) -> dict[str, int]:
        """Lifetime counters: admitted, started, finished, cancelled, expired_waiting, ..."""
        with self._cond:
            return dict(self._counts)

    # ---- event-loop side ----------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> list[int]:
        gen = self._generator
        assert gen is not None
        if request.task == Task.QUERY:
            if request.choices and request.regex is not None:
                raise EngineError(
                    ErrorCode.INVALID_ARGUMENT, "choices and regex cannot both be set", "choices"
                )
            if request.regex is not None:
                try:
                    _check_regex(request.regex)
                except ValueError as err:
                    raise EngineError(
                        ErrorCode.INVALID_ARGUMENT, f"regex does not compile: {err}", "regex"
                    ) from None
            if request.choices and not all(request.choices):
                raise EngineError(
                    ErrorCode.INVALID_ARGUMENT, "choices: must be non-empty strings", "choices"
                )
            if request.choices or request.regex is not None:
                raise EngineError(
                    ErrorCode.UNIMPLEMENTED,
                    "the reference engine does not enforce choices or regex "
                    "answer constraints (the batched engine does)",
                )
        if request.task == Task.SEGMENT:
            raise EngineError(
                ErrorCode.UNIMPLEMENTED, "the reference engine does not implement segment"
            )
        if request.task in (Task.POINT, Task.DETECT, Task.SEGMENT) and request.image is None:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{request.task} needs an image", "image")
        if request.task == Task.CAPTION:
            if request.image is None:
                raise EngineError(ErrorCode.INVALID_ARGUMENT, "caption needs an image", "image")
            try:
                prompt = prompts.caption_prompt(gen.contract, request.caption_length)
            except ValueError as err:
                raise EngineError(ErrorCode.INVALID_ARGUMENT, str(err), "caption_length") from None
        elif request.task == Task.QUERY:
            prompt = prompts.query_prompt(gen.contract, gen.tokenizer, request.question)
        elif request.task == Task.POINT:
            prompt = prompts.point_prompt(gen.contract, gen.tokenizer, request.object_name)
        else:
            prompt = prompts.detect_prompt(gen.contract, gen.tokenizer, request.object_name)
        self._check_size(request, len(prompt))
        return prompt

    def _check_size(self, request: GenerationRequest, prompt_len: int) -> None:
        config = self.info
        assert self._generator is not None
        # Without an image the prompt starts with BOS alone.
        image_positions = self._generator.config.image_prefix_len if request.image else 1
        prefix = image_positions + prompt_len
        if request.task in _POSITIONS_PER_OBJECT:
            name = "max_objects"
            budget = _POSITIONS_PER_OBJECT[request.task] * request.max_objects
        else:
            name, budget = "max_tokens", request.max_tokens
        if prefix + budget > config.max_context:
            raise EngineError(
                ErrorCode.OUT_OF_RANGE,
                f"the prompt ({prefix} positions) plus {name} ({budget} positions) exceeds the "
                f"model's context of {config.max_context}",
                name,
            )
        need = (prefix + budget) * self._kv_bytes_per_position
        if self._kv_budget_bytes and need > self._kv_budget_bytes:
            raise EngineError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the request needs {prefix + budget} KV positions ({need} bytes); the KV "
                f"budget is {self._kv_budget_bytes} bytes",
                name,
            )

    def _cancel(self, job: _Job) -> None:
        with self._cond:
            job.cancelled.set()
            if job not in self._waiting:
                return  # running (the worker sees the flag) or already done
            self._waiting.remove(job)
            self._counts["cancelled"] += 1
        job.stream.push(Finished(finish_reason="cancelled"))
        self._finish_job(job)

    def _expire_waiting(self, job: _Job) -> None:
        with self._cond:
            if job not in self._waiting:
                return
            self._waiting.remove(job)
            self._counts["expired_waiting"] += 1
        job.stream.push(
            EngineError(
                ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was queued"
            )
        )
        self._finish_job(job)

    def _finish_job(self, job: _Job) -> None:
        # Runs on the event loop; called once per job, whichever way it ended.
        if job.deadline_timer is not None:
            job.deadline_timer.cancel()
        with self._cond:
            idle = self._running is None and not self._waiting
        if idle and self._idle is not None:
            self._idle.set()

    # ---- worker thread ------------------------------------------------------------------

    def _main(self, loaded: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            model = self._load()
            self._generator = ReferenceGenerator(model.model, model.tokenizer)
            self._vocab = TokenVocab.from_tokenizer(model.tokenizer)
            config = model.config
            text = config.text
            self._kv_bytes_per_position = (
                2 * text.n_layers * text.n_kv_heads * text.head_dim * model.model.dtype.itemsize
            )
            self._info = EngineInfo(
                model_name=config.name,
                preset=config.name,
                token_contract=config.tokens.name if config.tokens else "",
                device=str(model.model.device),
                dtype=_DTYPE_NAMES.get(model.model.dtype, str(model.model.dtype)),
                pipeline_depth=1,
                max_batch_size=1,
                max_context=config.text.max_context,
                max_queue=self._max_queue,
            )
        except BaseException as err:  # start() re-raises it on the event loop
            loop.call_soon_threadsafe(_set_exception, loaded, err)
            return
        loop.call_soon_threadsafe(_set_result, loaded)
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._serve(job)
            finally:
                with self._cond:
                    self._running = None
                try:
                    loop.call_soon_threadsafe(self._finish_job, job)
                except RuntimeError:
                    return  # the loop is gone

    def _serve(self, job: _Job) -> None:
        started = time.monotonic()
        deadline = job.request.deadline
        if job.cancelled.is_set():
            with self._cond:
                self._counts["cancelled"] += 1
            job.stream.push(self._cancelled_event())
            return
        if deadline is not None and started >= deadline:
            with self._cond:
                self._counts["expired_waiting"] += 1
            job.stream.push(
                EngineError(
                    ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was queued"
                )
            )
            return
        with self._cond:
            self._counts["started"] += 1
        metrics = RequestMetrics(
            queue_wait_ms=(started - job.admitted) * 1e3, input_tokens=len(job.prompt)
        )
        try:
            if job.request.task in (Task.CAPTION, Task.QUERY):
                event = self._text(job, started, metrics)
            else:
                event = self._regions(job, started, metrics)
        except _DeadlineExceeded:
            event = EngineError(
                ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was running"
            )
        except ContextOverflow as err:
            event = EngineError(ErrorCode.OUT_OF_RANGE, str(err), "max_tokens")
        except ValueError as err:
            event = EngineError(ErrorCode.INVALID_ARGUMENT, str(err))
        except Exception as err:
            log.exception("request %s failed", job.request.request_id)
            event = EngineError(ErrorCode.INTERNAL, f"internal error: {type(err).__name__}")
        if isinstance(event, Finished) and event.finish_reason == "cancelled":
            event = self._cancelled_event()
        key = (
            "cancelled"
            if job.cancelled.is_set()
            else "failed"
            if isinstance(event, EngineError)
            else "finished"
        )
        with self._cond:
            self._counts[key] += 1
        job.stream.push(event)

    def _text(self, job: _Job, started: float, metrics: RequestMetrics) -> Finished:
        gen, req = self._generator, job.request
        assert gen is not None and self._vocab is not None
        detok = StreamDetokenizer(self._vocab)
        marks = {"first": 0.0, "last": 0.0}
        expired = False

        def on_token(token: int) -> bool:
            nonlocal expired
            now = time.monotonic()
            if not marks["first"]:
                marks["first"] = now
            else:
                self._last_step_ms = (now - marks["last"]) * 1e3
            marks["last"] = now
            text = detok.push(token)
            if text:
                job.stream.push(TextDelta(text))
            self._after_token(job)
            if req.deadline is not None and time.monotonic() >= req.deadline:
                expired = True
            return expired or job.cancelled.is_set()

        settings = SamplingSettings(
            temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens, seed=req.seed
        )
        result = (
            gen.caption(req.image, req.caption_length, settings, on_token)
            if req.task is Task.CAPTION
            else gen.query(req.image, req.question, settings, on_token)
        )
        if expired:
            raise _DeadlineExceeded
        tail = detok.flush()
        if tail:
            job.stream.push(TextDelta(tail))
        end = time.monotonic()
        first = marks["first"] or end
        metrics.time_to_first_token_ms = (first - job.admitted) * 1e3
        metrics.prefill_ms = (first - started) * 1e3
        metrics.decode_ms = (end - first) * 1e3
        metrics.output_tokens = len(result.token_ids)
        return Finished(finish_reason=result.finish_reason, text=result.text, metrics=metrics)

    def _regions(self, job: _Job, started: float, metrics: RequestMetrics) -> Finished:
        gen, req = self._generator, job.request
        assert gen is not None and req.image is not None
        result = (gen.detect if req.task == Task.DETECT else gen.point)(
            req.image, req.object_name, req.max_objects
        )
        end = time.monotonic()
        if req.deadline is not None and end >= req.deadline:
            raise _DeadlineExceeded
        # The reference loop has no per-step hook: the whole run counts as time to the answer.
        metrics.time_to_first_token_ms = (end - job.admitted) * 1e3
        metrics.decode_ms = (end - started) * 1e3
        n = len(result.points) + len(result.boxes)
        metrics.output_tokens = n * _POSITIONS_PER_OBJECT[req.task]
        return Finished(
            finish_reason=result.finish_reason,
            metrics=metrics,
            points=[Point(p.x, p.y) for p in result.points],
            boxes=[Box(b.x_min, b.y_min, b.x_max, b.y_max) for b in result.boxes],
        )

    def _cancelled_event(self) -> Event | EngineError:
        # A request stopped by close() must not look like a normal end to its consumer.
        if self._closed:
            return EngineError(
                ErrorCode.UNAVAILABLE, "the server shut down while the request was running"
            )
        return Finished(finish_reason="cancelled")

    def _after_token(self, job: _Job) -> None:
        """Called on the worker thread after each text token; a seam for tests to pause."""


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)
