"""The scheduler: one thread owns the device and runs `tick` in a loop.

A tick is three named calls, in this order (commit-before-finalize):

1. `_commit` the oldest in-flight step, once the pipeline is full (or nothing else can be
   launched): wait for its device-to-host copy (the tick's single host-device sync), advance
   each sequence's grammar, stream text, deliver results of sequences that finished, release
   the ones no in-flight step references any more (zombies wait for their last step).
2. `_finalize` the step in flight that has not been sampled: build each row's mask index and
   sampling parameters from the now-committed state, upload them on the copy stream, and
   enqueue mask + sample + region values + next-input embeddings on the compute stream.
3. `_launch` the next forward into the free slot: every running sequence's decode row, plus
   prefill chunks of admitted sequences (and newly admitted ones) under the step's token budget
   (core/step_plan.py): a mixed step; without prefill work, a decode-only step (the graphed
   path on CUDA). Decode rows read the inputs finalize wrote on the device.

At depth 1 the same calls run as launch -> finalize -> commit, one step at a time (blocking).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from decoding.grammar_base import GrammarEnd
from decoding.grammars import ObjectGrammar, SegmentGrammar, TextGrammar
from decoding.mask_table import NO_MASK
from decoding.segment_output import SegmentResult
from vlm_server.engine.api import (
    Box,
    Emitted,
    EngineError,
    EngineStats,
    ErrorCode,
    Finished,
    FinishReason,
    Point,
    Segmentation,
    TextDelta,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.observer import NO_OBSERVER, Observer
from vlm_server.engine.core.pipeline import LaunchKind, PipelineState, SlotState, Step
from vlm_server.engine.core.prefix_cache import PrefixCache, PrefixEntry
from vlm_server.engine.core.runtime_protocol import Runtime
from vlm_server.engine.core.sequence import SeqState, Sequence
from vlm_server.engine.core.step_layout import (
    F_MASK,
    F_PHASE,
    F_ROW,
    F_SEED,
    F_STEP,
    F_TEMP,
    F_TOP_P,
    N_FIN,
    RowPhase,
)
from vlm_server.engine.core.step_plan import Chunk, StepBudget, StepPlan


class Scheduler:
    def __init__(
        self,
        runtime: Runtime,
        cfg: EngineConfig,
        eos_id: int,
        image_prefix_len: int,
        observer: Observer = NO_OBSERVER,
        pipeline: PipelineState[Sequence] | None = None,
    ) -> None:
        self.rt = runtime
        self.cfg = cfg
        self.eos_id = eos_id
        self.observer = observer
        self.pipe: PipelineState[Sequence] = pipeline or PipelineState(cfg.pipeline_depth)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted and not yet finished
        self.zombies: list[Sequence] = []  # finished, still referenced by an in-flight step
        self.free_rows = list(range(cfg.max_rows - 1, -1, -1))
        self.prefix_cache = PrefixCache(runtime.pages, image_prefix_len, cfg.prefix_cache_entries)
        # New image prefixes the device is still computing (on its prefill stream), oldest first.
        self.pending_prefixes: list[PrefixEntry] = []
        self.last_batch = 0
        self.last_step_ms = 0.0
        self._last_commit_at = 0.0

    # ---- queries ----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pipe.n_in_flight or self.pending_prefixes)

    def stalled_on_prefixes(self) -> bool:
        """Nothing to launch or commit until an image prefix is ready: the caller may sleep a
        little (new requests wake it) instead of ticking in a busy loop."""
        return bool(self.pending_prefixes and not self.pipe.n_in_flight and not self._launchable())

    def stats(self) -> EngineStats:
        return EngineStats(
            queue_depth=len(self.waiting),
            active_sequences=len(self.running),
            kv_pages_in_use=self.rt.pages.used_pages,
            kv_pages_total=self.rt.pages.n_pages - 1,
            last_batch_size=self.last_batch,
            last_step_ms=self.last_step_ms,
            prefix_hits=self.prefix_cache.hits,
            prefix_lookups=self.prefix_cache.lookups,
        )

    def worst_case_pages(self, seq: Sequence) -> int:
        """The most free pages admitting ``seq`` can take: its own pages (prompt + output
        budget, and a private copy of a partly filled prefix page) plus its whole image prefix,
        as if not cached. Admission refuses a request above the cache's size with it."""
        total = self.rt.pages.pages_for(seq.total_positions)
        if seq.prefix_len == 0:
            return total
        cache = self.prefix_cache
        shared = cache.pages_per_entry - (1 if cache.has_tail else 0)
        return total - shared + cache.pages_per_entry

    def pages_to_admit(self, seq: Sequence) -> int:
        """Free pages admitting ``seq`` takes now (its prefix's pages only if not cached)."""
        worst = self.worst_case_pages(seq)
        if seq.prefix_len and self.prefix_cache.peek(seq.request.image.content_hash) is not None:
            return worst - self.prefix_cache.pages_per_entry
        return worst

    # ---- the tick ---------------------------------------------------------------------

    def tick(self) -> None:
        """One scheduler iteration (see the module docstring for the order and why)."""
        self._sweep_cancelled()
        self._poll_prefixes()
        pipe = self.pipe
        t0 = time.perf_counter()
        if pipe.n_in_flight and (pipe.n_in_flight >= pipe.depth or not self._launchable()):
            oldest = pipe.in_flight[0]
            if oldest.state is SlotState.LAUNCHED:  # depth 1: sample before committing
                self._finalize(oldest)
            self._commit(pipe.pop_oldest())
        t1 = time.perf_counter()
        step = pipe.unfinalized()
        if step is not None:
            self._finalize(step)
        t2 = time.perf_counter()
        if pipe.can_launch():
            self._launch()
        self.observer.tick(t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _launchable(self) -> bool:
        if any(s.wants_decode_step() or s.wants_prefill_chunk() for s in self.running):
            return True
        return bool(self.waiting) and self._can_admit(self.waiting[0])

    # ---- launch -----------------------------------------------------------------------

    def _launch(self) -> None:
        decode = [s for s in self.running if s.wants_decode_step()][: self.cfg.max_batch]
        budget = StepBudget(self.cfg.max_step_tokens, len(decode))
        prefill: list[Sequence] = []
        chunks: list[Chunk] = []
        for s in self.running:  # admission order: the oldest prefill first
            if s.wants_prefill_chunk():
                if not budget.can_take():
                    break
                chunks.append(self._chunk(s, budget.take(len(s.prompt) - s.prefill_launched)))
                prefill.append(s)
        for s, chunk in self._admit(budget):
            chunks.append(chunk)
            prefill.append(s)
        if not decode and not prefill:
            return
        seqs = decode + prefill
        if prefill:
            plan = StepPlan(len(decode), chunks)
            step = self.pipe.launch(LaunchKind.MIXED, seqs, plan)
            self.observer.launched(step)
            self.rt.launch_mixed(step.slot, seqs, plan)
        else:
            step = self.pipe.launch(LaunchKind.DECODE, seqs)
            self.observer.launched(step)
            self.rt.launch_decode(step.slot, seqs)
        for s in decode:
            s.decode_launched += 1
        for s, chunk in zip(prefill, chunks, strict=True):
            s.prefill_launched += chunk.length
        for s in seqs:
            s.add_ref()
        self.last_batch = len(decode)

    @staticmethod
    def _chunk(seq: Sequence, length: int) -> Chunk:
        start = seq.prefill_launched
        return Chunk(start, length, start + length == len(seq.prompt))

    def _poll_prefixes(self) -> None:
        """Mark the image prefixes the device finished as ready (a non-blocking query)."""
        if not self.pending_prefixes:
            return
        still = []
        for entry in self.pending_prefixes:
            if self.rt.prefix_ready(entry.pending):
                entry.ready, entry.pending = True, None
            else:
                still.append(entry)
        self.pending_prefixes = still

    def _prefix_batches_in_flight(self) -> int:
        return len({id(e.pending) for e in self.pending_prefixes})

    def _can_admit(self, seq: Sequence) -> bool:
        if not self.free_rows or len(self.running) >= self.cfg.max_batch:
            return False
        cache = self.prefix_cache
        free = self.rt.pages.free_pages + cache.evictable_pages()
        own_entry = cache.peek(seq.request.image.content_hash) if seq.prefix_len else None
        new_prefix = seq.prefix_len and own_entry is None
        if new_prefix and self._prefix_batches_in_flight() >= self.rt.prefix_slots:
            return False
        if own_entry is not None and own_entry.users == 0:
            free -= len(own_entry.pages)  # it will be used, so it cannot be evicted
        return self.pages_to_admit(seq) <= free

    def _admit(self, budget: StepBudget) -> list[tuple[Sequence, Chunk]]:
        """Admit waiting sequences (FIFO) while the step's budget, rows and pages allow:
        reserve prompt + output pages, share or create the image prefix, take a row, and
        plan each one's first chunk. New image prefixes of the admitted start on the device's
        prefill stream as one batch; their users' chunks wait until they are ready."""
        admitted: list[tuple[Sequence, Chunk]] = []
        new_prefixes: list[tuple[PrefixEntry, Sequence]] = []
        pages, cache = self.rt.pages, self.prefix_cache
        n_admitted = 0
        now = time.monotonic()
        while (
            self.waiting
            and n_admitted < self.cfg.max_prefill_batch
            and self.free_rows
            and len(self.running) < self.cfg.max_batch
        ):
            seq = self.waiting[0]
            if not seq.prompt:
                raise AssertionError("a request without prompt tokens")
            known = cache.peek(seq.request.image.content_hash) if seq.prefix_len else None
            if seq.prefix_len and known is None:
                # The prefill stream holds enough batches: admitting more would only hold
                # their pages and rows while they wait.
                if not new_prefixes and self._prefix_batches_in_flight() >= self.rt.prefix_slots:
                    break
            elif (known is None or known.ready) and not budget.can_take():
                break
            total = pages.pages_for(seq.total_positions)
            entry = None
            if seq.prefix_len:
                entry = cache.lookup(seq.request.image.content_hash)
                if entry is not None:
                    cache.acquire(entry)
                    own = total - len(entry.full_pages)
                    if not cache.evict_for(own):
                        cache.release(entry)
                        break
                    seq.prefix_hit = True
                else:
                    own = total - (cache.pages_per_entry - (1 if cache.has_tail else 0))
                    if not cache.evict_for(own + cache.pages_per_entry):
                        break
                    entry = cache.create(seq.request.image.content_hash)
                    entry.ready = False
                    new_prefixes.append((entry, seq))
                    seq.prefix_hit = False
                seq.metrics.cached_tokens = seq.prefix_len if seq.prefix_hit else 0
            else:
                own = total
                if not cache.evict_for(own):
                    break
            self.waiting.popleft()
            seq.prefix = entry
            seq.own_pages = pages.allocate(own)
            seq.row = self.free_rows.pop()
            pages.assign(seq.row, (entry.full_pages if entry else []) + seq.own_pages)
            self.running.append(seq)
            n_admitted += 1
            seq.state = SeqState.PREFILL
            seq.prefill_launched_at = now
            seq.metrics.queue_wait_ms = (now - seq.submitted_at) * 1e3
            if seq.wants_prefill_chunk():  # no image, or its prefix is ready
                admitted.append((seq, self._chunk(seq, budget.take(len(seq.prompt)))))
        if new_prefixes:
            handle = self.rt.launch_prefixes(
                [(entry.pages, seq.request.image) for entry, seq in new_prefixes]
            )
            for entry, _ in new_prefixes:
                entry.pending = handle
                self.pending_prefixes.append(entry)
        return admitted

    # ---- finalize ---------------------------------------------------------------------

    def _finalize(self, step: Step[Sequence]) -> None:
        b = len(step.seqs)
        fin = np.zeros((b, N_FIN), dtype=np.int64)
        floats = fin.view(np.float64)
        phases = []
        plan = step.plan
        for i, s in enumerate(step.seqs):
            # A chunk that does not end its prompt samples nothing: its row idles.
            phase = s.phase() if plan is None or plan.samples(i) else RowPhase.IDLE
            phases.append(phase)
            fin[i, F_ROW] = s.row
            fin[i, F_PHASE] = phase
            g = s.grammar
            fin[i, F_MASK] = g.mask_row if phase in (RowPhase.TOKEN, RowPhase.BOUNDARY) else NO_MASK
            fin[i, F_SEED] = s.request.seed
            if isinstance(g, TextGrammar):
                fin[i, F_STEP] = len(g.token_ids)
                floats[i, F_TEMP] = s.request.temperature
                floats[i, F_TOP_P] = s.request.top_p
            else:  # region answers and segment paths decode greedily, as the reference does
                floats[i, F_TOP_P] = 1.0
        step.phases = phases
        constrained = bool((fin[:, F_MASK] != NO_MASK).any())
        regions = any(p in (RowPhase.BOUNDARY, RowPhase.COORD, RowPhase.SIZE) for p in phases)
        self.observer.finalized(step)
        greedy = not (floats[:, F_TEMP] > 0).any()
        self.rt.finalize(step.slot, step.seqs, fin, constrained, regions, greedy)
        if plan is not None:
            for i, s in enumerate(step.seqs):
                if plan.ends_prefill(i) and s.state is SeqState.PREFILL:
                    s.state = SeqState.RUNNING
        self.pipe.mark_finalized(step)

    # ---- commit -----------------------------------------------------------------------

    def _commit(self, step: Step[Sequence]) -> None:
        self.observer.committed(step)
        out = self.rt.read_outputs(step.slot, len(step.seqs))
        values = out.tolist()  # host copy: the slot's buffer is handed back below
        self.pipe.complete(step)
        now = time.monotonic()
        if self._last_commit_at:
            self.last_step_ms = (now - self._last_commit_at) * 1e3
        self._last_commit_at = now
        plan = step.plan
        for i, (seq, phase, row) in enumerate(zip(step.seqs, step.phases, values, strict=True)):
            seq.drop_ref()
            if plan is not None and plan.ends_prefill(i):
                seq.metrics.prefill_ms = (now - seq.prefill_launched_at) * 1e3
            if not seq.finished:
                if seq.cancelled is not None:
                    self._fail(seq, seq.cancelled)
                elif phase != RowPhase.IDLE:
                    self._apply(seq, phase, row, now)
                    deadline = seq.request.deadline
                    if not seq.finished and deadline is not None and now > deadline:
                        self._fail(seq, ErrorCode.DEADLINE_EXCEEDED)
                elif seq.grammar.finished:
                    # Finished before its first step (e.g. a regex whose only answer is the
                    # empty string): nothing to sample, the answer is complete.
                    self._complete(seq, now)
            if seq.finished and seq.inflight_refs == 0:
                self._release(seq)

    def _apply(self, seq: Sequence, phase: int, row: list[float], now: float) -> None:
        g = seq.grammar
        token = int(row[0])
        if phase == RowPhase.TOKEN:
            before = len(g.token_ids) if isinstance(g, TextGrammar) else 0
            g.advance_token(token)
            if isinstance(g, TextGrammar) and len(g.token_ids) > before:
                self._first_output(seq, now)
                seq.metrics.output_tokens += 1
                text = seq.detok.push(token) if seq.detok is not None else ""
                if text:
                    seq.text_parts.append(text)
                    self._emit(seq, TextDelta(text))
            elif isinstance(g, SegmentGrammar):
                seq.metrics.output_tokens += 1
        elif phase == RowPhase.BOUNDARY:
            g.advance_token(token)
            self._first_output(seq, now)
            if g.next_kind.name == "COORD_X":
                g.advance_value(row[1])
        elif phase == RowPhase.COORD:
            g.advance_value(row[1])
        elif phase == RowPhase.SIZE:
            g.advance_value((row[2], row[3]))
        if g.finished:
            self._complete(seq, now)

    def _first_output(self, seq: Sequence, now: float) -> None:
        if not seq.first_token_at:
            seq.first_token_at = now
            seq.metrics.time_to_first_token_ms = (now - seq.submitted_at) * 1e3

    # ---- endings ----------------------------------------------------------------------

    def _complete(self, seq: Sequence, now: float) -> None:
        g = seq.grammar
        m = seq.metrics
        m.decode_ms = (now - seq.first_token_at) * 1e3 if seq.first_token_at else 0.0
        # The task's prompt tokens, as the API states: image positions and BOS not counted.
        m.input_tokens = len(seq.prompt) - (1 if seq.prefix_len == 0 else 0)
        stop = g.finish_reason is GrammarEnd.STOP
        reason = FinishReason.EOS if stop else FinishReason.LENGTH
        result = Finished(finish_reason=reason, metrics=m)
        if isinstance(g, TextGrammar):
            if seq.detok is not None:
                tail = seq.detok.flush()
                if tail:
                    seq.text_parts.append(tail)
                    self._emit(seq, TextDelta(tail))
            result.text = "".join(seq.text_parts)
        elif isinstance(g, ObjectGrammar):
            result.finish_reason = FinishReason.EOS if stop else FinishReason.MAX_OBJECTS
            m.output_tokens = len(g.objects)
            for obj in g.objects:
                if len(obj) == 2:
                    result.points.append(Point(*obj))
                else:
                    result.boxes.append(Box(*obj))
        elif isinstance(g, SegmentGrammar):
            img = seq.request.image
            result.segmentation = _segmentation(g.result((img.width, img.height)))
        self._finish(seq)
        self._emit(seq, result)

    def _fail(self, seq: Sequence, code: ErrorCode) -> None:
        message = (
            "the request's deadline passed"
            if code == ErrorCode.DEADLINE_EXCEEDED
            else "the request was cancelled"
        )
        self._finish(seq)
        self._emit(seq, EngineError(code, message))

    def _finish(self, seq: Sequence) -> None:
        seq.state = SeqState.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            if seq.inflight_refs:
                self.zombies.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.inflight_refs:
            raise AssertionError("release of a sequence still referenced in flight")
        self.observer.released(seq)
        self.rt.pages.release(seq.own_pages)
        seq.own_pages = []
        if seq.prefix is not None:
            self.prefix_cache.release(seq.prefix)
        self.rt.release_row(seq.row)
        # Mask rows only now: no in-flight step reads them, so the table may reuse them.
        seq.release_resources()
        self.free_rows.append(seq.row)
        seq.row = -1
        seq.state = SeqState.RELEASED
        if seq in self.zombies:
            self.zombies.remove(seq)

    def _sweep_cancelled(self) -> None:
        now = time.monotonic()
        for seq in list(self.waiting):
            d = seq.request.deadline
            if seq.cancelled is None and d is not None and now > d:
                seq.cancelled = ErrorCode.DEADLINE_EXCEEDED
            if seq.cancelled is not None:
                self.waiting.remove(seq)
                seq.state = SeqState.FINISHED
                seq.release_resources()  # never admitted: no step ever read its rows
                self._emit(
                    seq,
                    EngineError(
                        seq.cancelled,
                        "the request's deadline passed while queued"
                        if seq.cancelled == ErrorCode.DEADLINE_EXCEEDED
                        else "the request was cancelled",
                    ),
                )
        for seq in list(self.running):
            d = seq.request.deadline
            if seq.cancelled is None and d is not None and now > d:
                # Also stops a prefill between its chunks: no further chunk is launched.
                seq.cancelled = ErrorCode.DEADLINE_EXCEEDED
            if seq.cancelled is not None and seq.inflight_refs == 0:
                self._fail(seq, seq.cancelled)
                self._release(seq)

    def _emit(self, seq: Sequence, event: Emitted) -> None:
        emit = seq.emit
        if isinstance(event, Finished | EngineError):
            self.observer.ended(seq, event)
            # The last event: drop the link to the request's stream, which links back to the
            # sequence, so the pair (and its image) is freed without waiting for the cycle GC.
            seq.emit = None
        if emit is not None:
            emit(event)


def _segmentation(seg: SegmentResult) -> Segmentation:
    polygons = tuple(tuple(Point(x, y) for x, y in poly) for poly in seg.polygons)
    h, w = seg.mask_size
    return Segmentation(
        box=Box(*seg.box),
        svg_path=seg.path,
        polygons=polygons,
        mask_rle=tuple(seg.mask_counts),
        mask_height=h,
        mask_width=w,
    )
