"""The batched engine: an asyncio front over the scheduler thread.

`submit` validates a request, builds its prompt and grammar, and hands the sequence to the
scheduler thread through a lock-protected inbox; events come back to the event loop with
``loop.call_soon_threadsafe``. The scheduler thread owns the model and the device.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

import torch

from decoding.constraints import ConstraintCompiler
from decoding.detokenize import StreamDetokenizer
from decoding.grammars import (
    PathRows,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    TextGrammar,
    detect_grammar,
    point_grammar,
)
from decoding.mask_table import NO_MASK, AutomatonRows, MaskTable
from decoding.vocab import TokenVocab
from vlm_server import prompts
from vlm_server.engine.api import (
    EngineError,
    EngineInfo,
    EngineStats,
    ErrorCode,
    Event,
    Finished,
    GenerationRequest,
    Task,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.runtime import ModelRuntime
from vlm_server.engine.scheduler import Scheduler
from vlm_server.engine.sequence import Sequence
from vlm_server.weights.loader import LoadedModel

log = logging.getLogger(__name__)

SEGMENT_MAX_POINTS = 64
SEGMENT_MAX_PATH_TOKENS = 256


class _Stream:
    """Per-request event stream on the event loop; raises the EngineError that ended it."""

    def __init__(self, engine: BatchedEngine, seq: Sequence, loop: asyncio.AbstractEventLoop
                 ) -> None:
        self._engine = engine
        self._seq = seq
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._loop = loop
        self._done = False

    def push(self, event: object) -> None:
        """Called from the scheduler thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while not self._done:
            event = await self._queue.get()
            if isinstance(event, EngineError):
                self._done = True
                raise event
            if isinstance(event, Finished):
                self._done = True
            yield event  # type: ignore[misc]

    def cancel(self) -> None:
        if self._seq.cancelled is None and not self._seq.finished:
            self._seq.cancelled = ErrorCode.CANCELLED
            self._engine._wake()


class BatchedEngine:
    """Continuous batching over a paged KV cache with a two-slot pipeline."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None,
                 preset_name: str | None = None) -> None:
        self.loaded = loaded
        self.cfg = cfg or EngineConfig()
        model = loaded.model
        mc = model.config
        contract = mc.tokens
        assert contract is not None
        self.contract = contract
        self.info = EngineInfo(
            model_name=mc.name, preset=preset_name or mc.name, token_contract=contract.name,
            device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
            pipeline_depth=self.cfg.pipeline_depth, max_batch_size=self.cfg.max_batch,
            max_context=mc.text.max_context, max_queue=self.cfg.max_queue)
        self.table = MaskTable(mc.text.vocab_size, max_rows=self.cfg.mask_table_rows)
        self.vocab = TokenVocab.from_tokenizer(loaded.tokenizer)
        suppressed = list(contract.decode_suppressed_ids)
        self._suppress_row = self.table.allow_all_but(suppressed) if suppressed else NO_MASK
        self.constraints = ConstraintCompiler(self.vocab, self.table, contract.eos_id,
                                              blocked=frozenset(suppressed))
        self.region_rows = RegionRows.register(
            self.table, RegionTokens(contract.eos_id,
                                     contract.coord_id if contract.boundary_rule
                                     == "coord_or_eos" else None))
        self._path_rows = None
        self._compile_lock = threading.Lock()
        self.runtime = ModelRuntime(model, self.cfg, self.table)
        self.scheduler = Scheduler(self.runtime, self.cfg, contract.eos_id, mc.image_prefix_len)
        self._inbox: list[Sequence] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._failure: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Capture CUDA graphs (on CUDA), then start the scheduler thread."""
        if self.cfg.cuda_graphs and self.runtime.streams.is_cuda and not self.runtime.graphs:
            await asyncio.get_running_loop().run_in_executor(None, self.runtime.capture_graphs)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
            self._thread.start()

    async def drain(self, timeout: float) -> None:
        self._draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cv:
                busy = bool(self._inbox) or self.scheduler.has_work()
            if not busy:
                return
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()  # plain counters: a racy read is fine for metrics
        stats.queue_depth += len(self._inbox)
        return stats

    def idle(self) -> bool:
        """Every page free (cached image prefixes aside), every slot and row unused."""
        with self._cv:
            s = self.scheduler
            return (not self._inbox and not s.has_work() and not s.zombies
                    and len(s.free_rows) == self.cfg.max_rows
                    and all(x is None for x in s.pipe.slots))

    # ---- submission -------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> _Stream:
        if self._draining or self._stopping:
            raise EngineError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        if self._failure is not None:
            raise EngineError(ErrorCode.UNAVAILABLE, f"the engine failed: {self._failure}")
        seq = self._build(request)
        scheduler = self.scheduler
        total_pages = self.runtime.pages.n_pages - 1
        need = scheduler.rt.pages.pages_for(seq.total_positions) + (
            scheduler.prefix_cache.pages_per_entry if seq.prefix_len else 0)
        if need > total_pages:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"the request needs {need} KV pages but the cache has "
                              f"{total_pages}; lower max_tokens / max_objects", "max_tokens")
        stream = _Stream(self, seq, asyncio.get_running_loop())
        seq.emit = stream.push
        with self._cv:
            if len(self._inbox) + len(scheduler.waiting) >= self.cfg.max_queue:
                raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                                  f"the queue is full ({self.cfg.max_queue} waiting requests)")
            self._inbox.append(seq)
            self._cv.notify()
        return stream

    def _build(self, req: GenerationRequest) -> Sequence:
        """Prompt, grammar and limits of one request (raises EngineError naming the field)."""
        c, tok = self.contract, self.loaded.tokenizer
        mc = self.loaded.model.config
        if req.task is not Task.QUERY and req.image is None:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{req.task} needs an image", "image")
        if req.temperature < 0:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "temperature must be >= 0",
                              "temperature")
        if not 0 < req.top_p <= 1:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "top_p must be in (0, 1]", "top_p")
        if not 1 <= req.max_tokens <= mc.text.max_context:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"max_tokens must be in 1..{mc.text.max_context}", "max_tokens")
        if req.task in (Task.POINT, Task.DETECT) and req.max_objects < 1:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "max_objects must be >= 1",
                              "max_objects")
        try:
            if req.task is Task.CAPTION:
                prompt = prompts.caption_prompt(c, req.caption_length)
                grammar = TextGrammar(c.eos_id, req.max_tokens, row=self._suppress_row,
                                      first_row=NO_MASK)
            elif req.task is Task.QUERY:
                prompt = prompts.query_prompt(c, tok, req.question)
                grammar = TextGrammar(c.eos_id, req.max_tokens, row=self._suppress_row,
                                      first_row=NO_MASK, constraint=self._constraint(req))
            elif req.task in (Task.POINT, Task.DETECT):
                if not req.object_name.strip():
                    raise EngineError(ErrorCode.INVALID_ARGUMENT, "object must not be empty",
                                      "object")
                make = point_grammar if req.task is Task.POINT else detect_grammar
                build = prompts.point_prompt if req.task is Task.POINT else prompts.detect_prompt
                prompt = build(c, tok, req.object_name)
                grammar = make(self.region_rows, req.max_objects)
            else:
                if not req.object_name.strip():
                    raise EngineError(ErrorCode.INVALID_ARGUMENT, "object must not be empty",
                                      "object")
                prompt = prompts.segment_prompt(c, tok, req.object_name)
                grammar = SegmentGrammar(self.region_rows, self._segment_rows(),
                                         SEGMENT_MAX_POINTS,
                                         min(req.max_tokens, SEGMENT_MAX_PATH_TOKENS))
        except ValueError as err:
            if isinstance(err, EngineError):
                raise
            field = "caption_length" if req.task is Task.CAPTION else "task"
            code = (ErrorCode.UNIMPLEMENTED if "defines no segment" in str(err)
                    else ErrorCode.INVALID_ARGUMENT)
            raise EngineError(code, str(err), field) from err
        if req.image is None:
            prompt = [c.bos_id, *prompt]
            prefix_len = 0
        else:
            prefix_len = mc.image_prefix_len
        seq = Sequence(request=req, prompt=prompt, grammar=grammar, prefix_len=prefix_len)
        if seq.total_positions > mc.text.max_context:
            raise EngineError(
                ErrorCode.OUT_OF_RANGE,
                f"prompt ({seq.prefill_len} positions) plus the output budget "
                f"({grammar.max_positions}) exceeds the model context of "
                f"{mc.text.max_context}", "max_tokens")
        if isinstance(grammar, TextGrammar):
            seq.detok = StreamDetokenizer(self.vocab)
        return seq

    def _constraint(self, req: GenerationRequest) -> AutomatonRows | None:
        if req.choices and req.regex:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "give choices or regex, not both",
                              "regex")
        try:
            with self._compile_lock:
                if req.choices:
                    if any(not ch for ch in req.choices):
                        raise ValueError("choices must be non-empty strings")
                    return self.constraints.choices(req.choices)
                if req.regex is not None:
                    return self.constraints.regex(req.regex)
        except EngineError:
            raise
        except (ValueError, RuntimeError) as err:
            field = "choices" if req.choices else "regex"
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: {err}", field) from err
        return None

    def _segment_rows(self) -> PathRows:
        with self._compile_lock:
            if self._path_rows is None:
                self._path_rows = self.constraints.segment_path()
            return self._path_rows

    # ---- the scheduler thread ----------------------------------------------------------

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _run(self) -> None:
        s = self.scheduler
        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while not self._stopping and not self._inbox and not s.has_work():
                            self._cv.wait()
                        if self._stopping and not s.pipe.n_in_flight:
                            return
                        arrived, self._inbox = self._inbox, []
                    # The tick runs without the lock: submit() on the event loop never waits
                    # for device work.
                    s.waiting.extend(arrived)
                    s.tick()
        except BaseException as err:  # a bug or a device failure: fail every request loudly
            log.exception("scheduler thread failed")
            self._failure = err
            with self._cv:
                pending = list(s.waiting) + list(s.running) + self._inbox
            for seq in pending:
                if seq.emit is not None and not seq.finished:
                    seq.emit(EngineError(ErrorCode.INTERNAL, f"engine failure: {err}"))
