"""The scheduler: one thread owns the device and runs `tick` in a loop.

A tick is three named calls, in this order (commit-before-finalize):

1. `_commit` the oldest in-flight step, once the pipeline is full (or nothing else can be
   launched): wait for its device-to-host copy (the tick's single host-device sync), hand
   each row to its sequence's output (core/outputs.py: grammar, text, results) and deliver
   the events it returns, release the sequences that finished and no in-flight step
   references any more (zombies wait for their last step).
2. `_finalize` the step in flight that has not been sampled: build each row's mask index and
   sampling parameters from the now-committed state, upload them on the copy stream, and
   enqueue mask + sample + region values + next-input embeddings on the compute stream.
3. `_launch` the next forward into the free slot: every running sequence's decode row, plus
   prefill chunks of admitted sequences (and newly admitted ones) under the step's token budget
   (core/step_plan.py): a mixed step; without prefill work, a decode-only step (the graphed
   path on CUDA). Decode rows read the inputs finalize wrote on the device.

One exception to that order: a step launched into an empty pipeline has nothing older to
commit, so it is finalized first, before deciding what to launch; the first decode rows of the
prompts it ends then launch right behind it instead of after its commit.

Before those, each tick polls (without blocking) the image prefixes admission started on the
device's prefill stream: a prefix becomes ready once its batch's event completed, and only
then do the prompt chunks of its requests (and of any request for the same image admitted
meanwhile) join steps. At most ``runtime.prefix_slots`` batches are in flight. A first
user's short prompt rides its new prefix's forward instead (core/prefix_jobs.py) and needs
only a held row once the prefix is ready; when nothing else runs, that row's step is launched
at once, waiting for the prefix batch on the device rather than for the host to see it end.

While background work runs (core/headroom.py), new interactive pictures go to the runtime's
interactive lane instead, ahead of the steps (at most ``interactive_prefix_slots`` batches of
``interactive_prefill_batch``); a batch holds pictures of one lane only. When every
interactive request running is a prompt riding such a batch, the next step carries their held
rows at once, waiting for the batch on the device: the background rows it also carries wait
with them, and the interactive answers pay no host round trip.

Background work yields to interactive requests (``background_yield``): a step that
interactive sequences want carries only them, and no background picture batch starts while an
interactive picture is on its lane. While background work runs, a commit's wait (`step_wait`,
the engine's) also ends when requests arrive, so that an interactive picture starts on its
lane at once instead of after the commit.

At depth 1 the same calls run as launch -> finalize -> commit, one step at a time (blocking).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import chain, repeat
from operator import attrgetter

import numpy as np

from decoding.mask_table import NO_MASK
from vlm_server.engine.api import (
    EngineError,
    EngineStats,
    ErrorCode,
    Finished,
    GenerationRequest,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.admission import Admission
from vlm_server.engine.core.headroom import YIELDS_IN_A_ROW, Headroom, is_background
from vlm_server.engine.core.observer import NO_OBSERVER, Observer
from vlm_server.engine.core.outputs import Output, stopped
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.pipeline import LaunchKind, PipelineState, SlotState, Step
from vlm_server.engine.core.prefix_cache import PrefixCache, PrefixEntry
from vlm_server.engine.core.runtime_protocol import Runtime
from vlm_server.engine.core.sequence import SeqState, Sequence
from vlm_server.engine.core.step_clock import StepClock
from vlm_server.engine.core.step_inputs import LaunchInputs
from vlm_server.engine.core.step_layout import (
    F_MASK,
    F_PHASE,
    F_ROW,
    F_SEED,
    F_STEP,
    F_TEMP,
    F_TOP_P,
    N_FIN,
    O_TOKEN,
    REGION_PHASES,
    RowPhase,
)
from vlm_server.engine.core.step_plan import Chunk, StepBudget, StepPlan
from vlm_server.engine.core.wait_queue import WaitQueue

Emit = Callable[[object], None]


class Scheduler(Admission):
    def __init__(
        self,
        runtime: Runtime,
        cfg: EngineConfig,
        eos_id: int,
        image_prefix_len: int,
        observer: Observer = NO_OBSERVER,
        pipeline: PipelineState[Sequence] | None = None,
        flush_events: Callable[[], None] = lambda: None,
        pages: PageAllocator | None = None,
    ) -> None:
        self.rt = runtime
        # Where set, an answer that `answers_later` goes here with its emit and output, not
        # to its stream: a worker completes it off this thread (engine/segment_finisher.py).
        self.finish_later: Callable[[GenerationRequest, Finished, Emit, Output], None] | None = None
        # Sends the events emitted so far on their way (the engine batches them per tick):
        # called after the cancellation sweep and at the end of every tick.
        self.flush_events = flush_events
        self.cfg = cfg
        self.eos_id = eos_id
        self.observer = observer
        self.pipe: PipelineState[Sequence] = pipeline or PipelineState(cfg.pipeline_depth)
        # Highest priority first, FIFO within one (core/wait_queue.py).
        self.waiting: WaitQueue[Sequence] = WaitQueue(attrgetter("request.priority"))
        self.running: list[Sequence] = []  # admitted and not yet finished
        self.zombies: list[Sequence] = []  # finished, still referenced by an in-flight step
        self.free_rows = list(range(cfg.max_rows - 1, -1, -1))
        # The finalize columns that stay fixed while a sequence holds its row (row, seed,
        # temperature, top_p), written at admission: finalize gathers them in one numpy take
        # and fills only phase, mask and step per row. A row is reused only after release,
        # when no in-flight step references its sequence any more.
        self._row_fin = np.zeros((cfg.max_rows, N_FIN), np.int64)
        self._row_floats = self._row_fin.view(np.float64)  # temperature, top_p bit-cast
        # Each slot's fin is built in place: the runtime copies it into its pinned buffer
        # before finalize returns, and the slot's next finalize comes after its commit.
        self._fin = [np.zeros((cfg.max_rows, N_FIN), np.int64) for _ in self.pipe.slots]
        self.inputs = LaunchInputs(cfg.max_rows)  # the values each launch hands the runtime
        self._next_deadline = math.inf  # no running sequence's deadline is earlier
        # The KV pages are the scheduler's: its allocator writes the block table into the
        # runtime's pinned mirror, and each launch hands the runtime the rows it changed.
        if pages is None:
            mirror = runtime.block_table
            pages = PageAllocator(
                runtime.kv_pages, cfg.page_size, cfg.max_rows, mirror.shape[1], block_table=mirror
            )
        self.pages = pages
        self.prefix_cache = PrefixCache(self.pages, image_prefix_len, cfg.prefix_cache_entries)
        # What background work (priority < 0) may hold (core/headroom.py).
        self.headroom = Headroom(cfg, self.prefix_cache, self.pages.block_table.shape[1])
        # New image prefixes the device is still computing (on its prefill stream), oldest first.
        self.pending_prefixes: list[PrefixEntry] = []
        self.yield_prefill = cfg.background_yield in ("prefill", "all")
        self.yield_steps = cfg.background_yield in ("steps", "all")
        self.lane_batches_since_background = 0
        self._steps_yielded = 0  # steps in a row that background rows yielded
        self.last_batch = 0
        self.clock = StepClock()
        # Decode pacing (EngineConfig.decode_pace_ms); the clock and the sleep are the
        # scheduler's own so that tests can drive them.
        self.pace_s = cfg.decode_pace_ms / 1e3
        self.background_pace_s = cfg.background_pace_ms / 1e3
        self.last_decode_launch = -math.inf
        self.now: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], None] = time.sleep
        # Set by the engine where a commit's wait can be cut short: waits until ``step``'s
        # results are readable (True) or requests arrived meanwhile, moved into `waiting`
        # (False). Used while an interactive picture could start on its lane at once.
        self.step_wait: Callable[[Step[Sequence]], bool] | None = None

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
            kv_pages_in_use=self.pages.used_pages,
            kv_pages_total=self.pages.n_pages - 1,
            last_batch_size=self.last_batch,
            last_step_ms=self.clock.last_step_ms,
            prefix_hits=self.prefix_cache.hits,
            prefix_lookups=self.prefix_cache.lookups,
            step_interval_counts=tuple(self.clock.interval_counts),
            step_interval_sum_ms=self.clock.interval_sum_ms,
        )

    # ---- the tick ---------------------------------------------------------------------

    def tick(self) -> None:
        """One scheduler iteration (see the module docstring for the order and why)."""
        self._sweep_cancelled()
        self.flush_events()  # a commit may wait long (a test's gate): errors go out first
        self._poll_prefixes()
        pipe = self.pipe
        t0 = time.perf_counter()
        if pipe.n_in_flight == 1 < pipe.depth and pipe.in_flight[0].state is SlotState.LAUNCHED:
            # A lone step has nothing older to commit: sample it now, so the first decode
            # rows of the prompts it ends launch behind it instead of after its commit.
            self._finalize(pipe.in_flight[0])
        if pipe.n_in_flight and (pipe.n_in_flight >= pipe.depth or not self._launchable()):
            oldest = pipe.in_flight[0]
            if oldest.state is SlotState.LAUNCHED:  # depth 1: sample before committing
                self._finalize(oldest)
            self._admit_while_waiting(oldest)
            self._commit(pipe.pop_oldest())
        t1 = time.perf_counter()
        step = pipe.unfinalized()
        if step is not None:
            self._finalize(step)
        t2 = time.perf_counter()
        if pipe.can_launch():
            self._launch()
        self.observer.tick(t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.flush_events()

    def _admit_while_waiting(self, step: Step[Sequence]) -> None:
        """Wait for ``step``'s results, starting the pictures of interactive requests that
        arrive meanwhile on their lane at once (while background work runs), instead of after
        the commit: half a background step sooner on average."""
        wait = self.step_wait
        if wait is None or not self.rt.interactive_prefix_slots:
            return
        while self.headroom.rows and not wait(step):
            if self.waiting and self._starts_on_lane(self.waiting[0]):
                self._admit(StepBudget.spent(), interactive_only=True)

    def _starts_on_lane(self, seq: Sequence) -> bool:
        """Whether ``seq`` is an interactive request whose new picture admission would start
        on the interactive lane now."""
        return (
            bool(seq.prefix_len)
            and self._interactive_lane(seq)
            and self.prefix_cache.peek(seq.request.image.content_hash) is None
            and self._can_admit(seq)
        )

    def _launchable(self) -> bool:
        if self._chainable() or self._interactive_riders():
            return True
        if any(
            s.wants_decode_step() or s.wants_prefill_chunk() or s.wants_held_sample()
            for s in self.running
        ):
            return True
        return bool(self.waiting) and self._can_admit(self.waiting[0])

    # ---- launch -----------------------------------------------------------------------

    def _launch(self) -> None:
        running, interactive_only = self._step_candidates()
        decode = [s for s in running if s.wants_decode_step()][: self.cfg.max_batch_size]
        # Admission order, the oldest prefill first; the state test spares most rows a call.
        prefilling = [s for s in running if s.state is _PREFILL and s.wants_prefill_chunk()]
        # Prompts that ran with their image prefix: a row without tokens, outside the budget.
        prefill = [s for s in running if s.state is _PREFILL and s.wants_held_sample()]
        chunks = [Chunk.held(len(s.prompt)) for s in prefill]
        budget = StepBudget(self.cfg.max_step_tokens, len(decode))
        for s in prefilling:
            if not budget.can_take():
                break
            chunks.append(s.next_chunk(budget.take(len(s.prompt) - s.prefill_launched)))
            prefill.append(s)
        for s, chunk in self._admit(budget, interactive_only):
            chunks.append(chunk)
            prefill.append(s)
        after = None
        riders = []
        if not decode and not prefill and self._chainable():
            # Only prompts riding new prefixes: their held rows go now, behind the prefixes
            # on the device; the step's commit stands for the batch their pages wait for.
            riders = list(self.running)
        else:
            riders = self._interactive_riders()
        if riders and self._yields_steps():
            # Behind their batch, alone: the answers need not wait for background rows.
            decode, prefill, chunks = [], [], []
            interactive_only = True
        if riders:
            lane = riders[0].prefix.interactive_lane  # type: ignore[union-attr]
            # A lane runs its batches in order: its last one stands for every earlier one.
            last = [e for e in self.pending_prefixes if e.interactive_lane == lane][-1]
            after = last.pending
            for s in riders:
                s.rides_prefix = False
                s.drop_ref()
                chunks.append(Chunk.held(len(s.prompt)))
                prefill.append(s)
        if not decode and not prefill:
            return
        self._steps_yielded = self._steps_yielded + 1 if interactive_only else 0
        seqs = decode + prefill
        if prefill:
            plan = StepPlan(len(decode), chunks)
            inputs = self.inputs.mixed(seqs, plan, self.pages.take_dirty())
            step = self.pipe.launch(LaunchKind.MIXED, seqs, plan)
            self.observer.launched(step)
            self.rt.launch_mixed(step.slot, inputs, after)
        else:
            self._pace(decode)
            inputs = self.inputs.decode(seqs, self.pages.take_dirty())
            step = self.pipe.launch(LaunchKind.DECODE, seqs)
            self.observer.launched(step)
            self.rt.launch_decode(step.slot, inputs)
        for s in decode:
            s.decode_launched += 1
            s.add_ref()
        for s, chunk in zip(prefill, chunks, strict=True):
            s.prefill_launched += chunk.length
            s.held = False
            s.add_ref()
        self.last_batch = len(decode)

    def _pace(self, decode: list[Sequence]) -> None:
        """Before a decode step of ``decode``: while new pictures run on the image path, wait
        until ``decode_pace_ms`` after the last decode step's launch, or `background_pace_ms`
        for background rows alone beside an interactive picture (events out first). Not for a
        queue alone: requests waiting for rows would only slow everyone down."""
        now = self.now()
        pace = self._pace_s(decode) if self.pending_prefixes else 0.0
        if pace:
            wait = self.last_decode_launch + pace - now
            if wait > 0:
                self.flush_events()
                self.sleep(wait)  # the scheduler's own thread: the GPU's time goes to pictures
                now = self.now()
        self.last_decode_launch = now

    def _pace_s(self, decode: list[Sequence]) -> float:
        """The pace of a decode step of ``decode`` while pictures are pending."""
        if (
            self.background_pace_s > self.pace_s
            and any(e.interactive_lane for e in self.pending_prefixes)
            and all(is_background(s.request) for s in decode)
        ):
            return self.background_pace_s
        return self.pace_s

    def _step_candidates(self) -> tuple[list[Sequence], bool]:
        """The running sequences the next step may carry, and whether background work yields
        it: while it yields steps (`_yields_steps`) and an interactive sequence wants one (a
        waiting head too, when it would take a row of the step), only the interactive ones."""
        if not self._yields_steps():
            return self.running, False
        interactive = [s for s in self.running if not is_background(s.request)]
        if any(
            s.wants_decode_step() or s.wants_prefill_chunk() or s.wants_held_sample()
            for s in interactive
        ) or (self.waiting and self._takes_a_row_now(self.waiting[0])):
            return interactive, True
        return self.running, False

    def _yields_steps(self) -> bool:
        """Whether background rows may yield the next step (``yield_steps``, background work
        running, fewer than `YIELDS_IN_A_ROW` steps yielded in a row)."""
        return (
            self.yield_steps and bool(self.headroom.rows) and self._steps_yielded < YIELDS_IN_A_ROW
        )

    def _takes_a_row_now(self, seq: Sequence) -> bool:
        """Whether admitting interactive ``seq`` now would put its prompt into this step (no
        picture, or one whose prefix is ready)."""
        if is_background(seq.request) or not self._can_admit(seq):
            return False
        if not seq.prefix_len:
            return True
        entry = self.prefix_cache.peek(seq.request.image.content_hash)
        return entry is not None and entry.ready

    # ---- finalize ---------------------------------------------------------------------

    def _set_row_constants(self, seq: Sequence) -> None:
        """The fixed finalize columns of ``seq``'s row (see ``_row_fin``), and its adapter slot
        for the launches."""
        row = seq.row
        self.inputs.admit(row, seq.adapter_slot)
        fixed = [0] * N_FIN
        fixed[F_ROW] = row
        fixed[F_SEED] = seq.request.seed
        self._row_fin[row] = fixed
        floats = self._row_floats
        if seq.is_text:
            floats[row, F_TEMP] = seq.request.temperature
            floats[row, F_TOP_P] = seq.request.top_p
        else:  # region answers and segment paths decode greedily, as the reference does
            floats[row, F_TOP_P] = 1.0

    def _finalize(self, step: Step[Sequence]) -> None:
        seqs = step.seqs
        b = len(seqs)
        plan = step.plan
        # One Python pass for what changes every step; a chunk that does not end its prompt
        # samples nothing: its row idles.
        if plan is None:
            states = [s.row_state(True) for s in seqs]
        else:
            states = [s.row_state(plan.samples(i)) for i, s in enumerate(seqs)]
        # row | mask | phase | step per step row: mask and phase are adjacent in fin too
        cols = np.fromiter(chain.from_iterable(states), np.int64, 4 * b).reshape(b, 4)
        fin = self._fin[step.slot][:b]
        self._row_fin.take(cols[:, 0], axis=0, out=fin)
        fin[:, F_MASK : F_PHASE + 1] = cols[:, 1:3]
        fin[:, F_STEP] = cols[:, 3]
        step.phases = cols[:, 2].tolist()  # host numpy (this package has no torch): no sync
        step.regions = bool(_REGION_PHASE[cols[:, 2]].any())
        constrained = bool((cols[:, 1] != NO_MASK).any())
        self.observer.finalized(step)
        greedy = not fin[:, F_TEMP].view(np.float64).max() > 0
        self.rt.finalize(step.slot, fin, constrained, step.regions, greedy)
        if plan is not None:
            for i in range(plan.n_decode, b):
                s = seqs[i]
                if plan.ends_prefill(i) and s.state is SeqState.PREFILL:
                    s.state = SeqState.RUNNING
        self.pipe.mark_finalized(step)

    # ---- commit -----------------------------------------------------------------------

    def _commit(self, step: Step[Sequence]) -> None:
        self.observer.committed(step)
        seqs = step.seqs
        t = time.perf_counter()
        out = self.rt.read_outputs(step.slot, len(seqs))
        self.observer.waited(time.perf_counter() - t)
        # Host copies (the slot's buffer is handed back below): the sampled ids as ints in one
        # array op, each row's values only when the step decoded region values.
        # `out` is host memory read_outputs already waited for (the tick's one wait).
        tokens = out[:, O_TOKEN].astype(np.int64).tolist()
        values = out.tolist() if step.regions else repeat(None, len(seqs))
        self.pipe.complete(step)
        now = time.monotonic()
        plan = step.plan
        self.clock.committed(now, plan is None or plan.n_decode > 0)
        if plan is not None:  # the prompts whose last chunk this step ran
            for i in range(plan.n_decode, len(seqs)):
                if plan.ends_prefill(i):
                    seqs[i].prefill_ended(now)
        # Running requests' deadlines are at or after `_next_deadline` (admission and the
        # sweep keep it so): until it passed, no row needs a look at its own.
        late = now > self._next_deadline
        for seq, phase, token, row in zip(seqs, step.phases, tokens, values, strict=True):
            seq.drop_ref()
            if not seq.finished:
                if seq.cancelled is not None:
                    self._fail(seq, seq.cancelled)
                elif phase != _IDLE_INT:
                    delta = seq.output.commit(phase, token, row, now)
                    if delta is not None and seq.emit is not None:
                        seq.emit(delta)
                    if seq.grammar.finished:
                        self._complete(seq, now)
                    elif late and (d := seq.request.deadline) is not None and now > d:
                        self._fail(seq, ErrorCode.DEADLINE_EXCEEDED)
                elif seq.grammar.finished:
                    # Finished before its first step (e.g. a regex whose only answer is the
                    # empty string): nothing to sample, the answer is complete.
                    self._complete(seq, now)
            if seq.inflight_refs == 0 and seq.finished:
                self._release(seq)

    # ---- endings ----------------------------------------------------------------------

    def _complete(self, seq: Sequence, now: float) -> None:
        """Deliver the answer of ``seq``, whose grammar finished (core/outputs.py builds it);
        one that `answers_later` goes through `finish_later`, when set."""
        output = seq.output
        later = self.finish_later if output.answers_later and seq.emit is not None else None
        tail, result = output.finish(seq, now, defer=later is not None)
        if tail is not None and seq.emit is not None:
            seq.emit(tail)
        self._finish(seq)
        if later is not None:
            self.observer.ended(seq, result)
            emit, seq.emit = seq.emit, None
            later(seq.request, result, emit, output)  # delivers the final event later
            return
        self._end(seq, result)

    def _fail(self, seq: Sequence, code: ErrorCode) -> None:
        self._finish(seq)
        self._end(seq, stopped(code))

    def _finish(self, seq: Sequence) -> None:
        seq.state = SeqState.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self.headroom.ended(seq.request)
            if seq.inflight_refs:
                self.zombies.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.inflight_refs:
            raise AssertionError("release of a sequence still referenced in flight")
        self.observer.released(seq)
        self.pages.release(seq.own_pages)
        seq.own_pages = []
        if seq.prefix is not None:
            self.prefix_cache.release(seq.prefix)
        self.pages.clear(seq.row)  # its block-table row back to the sink page
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
                self._end(seq, stopped(seq.cancelled, queued=True))
        if now > self._next_deadline:  # some running deadline passed: check them all
            self._next_deadline = math.inf
            for seq in self.running:
                d = seq.request.deadline
                if d is None or seq.cancelled is not None:
                    continue
                if now > d:
                    # Also stops a prefill between its chunks: no further chunk is launched.
                    seq.cancelled = ErrorCode.DEADLINE_EXCEEDED
                else:
                    self._next_deadline = min(self._next_deadline, d)
        # Cancellation is a flag set from other threads, so every tick looks at each one.
        for seq in [s for s in self.running if s.cancelled is not None]:
            if seq.inflight_refs == 0:
                self._fail(seq, seq.cancelled)  # type: ignore[arg-type]
                self._release(seq)

    def _end(self, seq: Sequence, event: Finished | EngineError) -> None:
        """Deliver the last event of ``seq``."""
        self.observer.ended(seq, event)
        # Drop the link to the request's stream, which links back to the sequence, so the
        # pair (and its image) is freed without waiting for the cycle GC.
        emit, seq.emit = seq.emit, None
        if emit is not None:
            emit(event)


_IDLE = RowPhase.IDLE
_IDLE_INT = int(_IDLE)  # a step's phases come back as ints, compared fastest with ints
_PREFILL = SeqState.PREFILL


_REGION_PHASE = np.isin(np.arange(len(RowPhase)), list(REGION_PHASES))  # by phase value
assert F_PHASE == F_MASK + 1  # finalize writes both columns in one slice
