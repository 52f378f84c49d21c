"""Admission and image prefixes in flight: the part of the scheduler (core/scheduler.py) that
takes waiting sequences into rows and pages and starts their new image prefixes on a prefill
lane, and that follows those prefixes until the device finished them.

Admission takes the queue's head first (core/wait_queue.py: highest priority, then arrival)
while the step's budget, rows and pages allow, background work within core/headroom.py's
limits; a head that cannot be admitted stops it. New pictures of the admitted go to the
device as one batch of one lane: the prefill stream, or while background work runs and the
runtime has one, the interactive lane for interactive pictures. A prompt short enough rides
its new prefix's batch and then needs only a held row; such held rows may be chained into a
step that waits for their batch on the device (`_chainable`, `_interactive_riders`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.headroom import YIELDS_IN_A_ROW, Headroom, is_background
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.pipeline import PipelineState
from vlm_server.engine.core.prefix_cache import PrefixCache, PrefixEntry
from vlm_server.engine.core.runtime_protocol import Runtime
from vlm_server.engine.core.sequence import SeqState, Sequence
from vlm_server.engine.core.step_inputs import LaunchInputs
from vlm_server.engine.core.step_plan import Chunk, StepBudget
from vlm_server.engine.core.wait_queue import WaitQueue


class Admission:
    """The scheduler's admission and prefix tracking (a base of `Scheduler`, which owns the
    state declared here)."""

    rt: Runtime
    cfg: EngineConfig
    pipe: PipelineState[Sequence]
    waiting: WaitQueue[Sequence]
    running: list[Sequence]
    free_rows: list[int]
    inputs: LaunchInputs
    pages: PageAllocator
    prefix_cache: PrefixCache
    headroom: Headroom
    pending_prefixes: list[PrefixEntry]
    _next_deadline: float
    # EngineConfig.background_yield's parts: no background picture batch starts while an
    # interactive picture is on its lane; a step with interactive rows carries only those.
    yield_prefill: bool
    yield_steps: bool
    # Interactive lane batches started since the last batch holding background pictures.
    lane_batches_since_background: int

    if TYPE_CHECKING:

        def _set_row_constants(self, seq: Sequence) -> None: ...

    def worst_case_pages(self, seq: Sequence) -> int:
        """The most free pages admitting ``seq`` can take: its own pages (prompt + output
        budget, and a private copy of a partly filled prefix page) plus its whole image prefix,
        as if not cached. Admission refuses a request above the cache's size with it."""
        if seq.prefix_len == 0:
            return self.pages.pages_for(seq.total_positions)
        return self.prefix_cache.pages_with_new_prefix(seq.total_positions)

    def pages_to_admit(self, seq: Sequence) -> int:
        """Free pages admitting ``seq`` takes now (its prefix's pages only if not cached)."""
        worst = self.worst_case_pages(seq)
        if seq.prefix_len and self.prefix_cache.peek(seq.request.image.content_hash) is not None:
            return worst - self.prefix_cache.pages_per_entry
        return worst

    def _chainable(self) -> bool:
        """Nothing runs but prompts riding image prefixes still on the device (of one lane),
        and nothing waits: sampling their first outputs can be queued behind those prefixes at
        once, instead of after the host saw them finish (a request alone saves that round
        trip)."""
        return (
            not self.pipe.n_in_flight
            and not self.waiting
            and bool(self.running)
            and all(_riding(s) for s in self.running)
            and len({s.prefix.interactive_lane for s in self.running}) == 1  # type: ignore[union-attr]
        )

    def _interactive_riders(self) -> list[Sequence]:
        """Prompts riding batches of the interactive lane, when they are all the interactive
        requests running (else none): their held rows may wait on the device for the lane,
        holding back background rows only."""
        if not any(e.interactive_lane for e in self.pending_prefixes):
            return []
        riders = []
        for s in self.running:
            if is_background(s.request):
                continue
            if not (_riding(s) and s.prefix.interactive_lane):  # type: ignore[union-attr]
                return []
            riders.append(s)
        return riders

    def _poll_prefixes(self) -> None:
        """Mark the image prefixes the device finished as ready (a non-blocking query)."""
        if not self.pending_prefixes:
            return
        still, ready = [], []
        for entry in self.pending_prefixes:
            if self.rt.prefix_ready(entry.pending):
                entry.ready, entry.pending = True, None
                ready.append(entry)
            else:
                still.append(entry)
        self.pending_prefixes = still
        if ready:
            now = time.monotonic()
            for s in self.running:
                if not any(s.prefix is e for e in ready):
                    continue
                if not s.metrics.prefix_wait_ms:  # a chained held row may have set it
                    s.metrics.prefix_wait_ms = (now - s.prefill_launched_at) * 1e3
                if s.rides_prefix:  # the prefill stream no longer writes its pages
                    s.rides_prefix = False
                    s.drop_ref()

    def _prefix_batches_in_flight(self, interactive: bool = False) -> int:
        """Batches of one lane that may still run (the interactive one's, or the other's)."""
        return len(
            {id(e.pending) for e in self.pending_prefixes if e.interactive_lane == interactive}
        )

    def _lane_full(self, interactive: bool) -> bool:
        slots = self.rt.interactive_prefix_slots if interactive else self.rt.prefix_slots
        return self._prefix_batches_in_flight(interactive) >= slots

    def _interactive_lane(self, seq: Sequence) -> bool:
        """Whether a new picture of ``seq`` goes to the interactive lane: an interactive
        request while background work runs, where the runtime has the lane."""
        return (
            bool(self.rt.interactive_prefix_slots)
            and bool(self.headroom.rows)
            and not is_background(seq.request)
        )

    def _background_picture_yields(self) -> bool:
        """Whether a new background picture waits: an interactive picture is on its lane
        (``yield_prefill``), and a background batch beside it would slow it down; at most
        `YIELDS_IN_A_ROW` lane batches in a row."""
        return (
            self.yield_prefill
            and self.lane_batches_since_background < YIELDS_IN_A_ROW
            and any(e.interactive_lane for e in self.pending_prefixes)
        )

    def _can_admit(self, seq: Sequence) -> bool:
        """Whether `_admit` would take ``seq`` at the head of the queue (the same rules)."""
        if not self.free_rows or len(self.running) >= self.cfg.max_batch_size:
            return False
        cache = self.prefix_cache
        entry = cache.peek(seq.request.image.content_hash) if seq.prefix_len else None
        new_prefix = seq.prefix_len and entry is None
        if new_prefix and self._lane_full(self._interactive_lane(seq)):
            return False
        if is_background(seq.request):
            if new_prefix and self._background_picture_yields():
                return False
            return self._background_fits(seq, entry, 0 if new_prefix else -1)
        return self.pages_to_admit(seq) <= cache.free_for(entry)

    def _background_fits(self, seq: Sequence, entry: PrefixEntry | None, in_batch: int) -> bool:
        """Whether background ``seq`` (its cached prefix ``entry``) keeps within its headroom;
        ``in_batch``: the pictures of the batch its new prefix would join (-1: none)."""
        left = self.prefix_cache.free_for(entry) - self.pages_to_admit(seq)
        return left >= 0 and self.headroom.admits(in_batch, left)

    def _admit(
        self, budget: StepBudget, interactive_only: bool = False
    ) -> list[tuple[Sequence, Chunk]]:
        """Admit waiting sequences, the head first, while the step's budget, rows and pages
        allow (background ones within core/headroom.py's limits): reserve prompt + output
        pages, share or create the image prefix, take a row, and plan each one's first chunk.
        New image prefixes of the admitted start on the device's prefill stream as one batch;
        their users' chunks wait until they are ready. A head that cannot be admitted stops
        admission: nothing of its priority or lower takes its place; ``interactive_only``:
        nor does a background head (a step that background work yields)."""
        admitted: list[tuple[Sequence, Chunk]] = []
        new_prefixes: list[tuple[PrefixEntry, Sequence]] = []
        pages, cache = self.pages, self.prefix_cache
        n_admitted = 0
        riding = 0  # prompt tokens riding this batch's new prefixes
        background_batch = False  # whether a background picture joined the new prefixes
        interactive_lane = False  # the lane of the new prefixes' batch
        now = time.monotonic()
        while (
            self.waiting
            and n_admitted < self.cfg.max_prefill_batch
            and self.free_rows
            and len(self.running) < self.cfg.max_batch_size
        ):
            seq = self.waiting[0]
            if not seq.prompt:
                raise AssertionError("a request without prompt tokens")
            known = cache.peek(seq.request.image.content_hash) if seq.prefix_len else None
            new_prefix = seq.prefix_len and known is None
            if new_prefix:
                lane = self._interactive_lane(seq)
                if not new_prefixes:
                    # The lane holds enough batches: admitting more would only hold their
                    # pages and rows while they wait.
                    if self._lane_full(lane):
                        break
                    interactive_lane = lane
                elif lane != interactive_lane or (
                    lane and len(new_prefixes) >= self.rt.interactive_prefill_batch
                ):
                    break  # a batch holds one lane's pictures, and the next tick goes on
            elif (known is None or known.ready) and not budget.can_take():
                break
            if is_background(seq.request):
                if interactive_only or (new_prefix and self._background_picture_yields()):
                    break
                if not self._background_fits(seq, known, len(new_prefixes) if new_prefix else -1):
                    break
                background_batch |= bool(new_prefix)
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
                    # Spatial references are encoded on the compute stream: no riding.
                    fits = riding + len(seq.prompt) <= self.rt.prefix_prompt_tokens
                    if fits and seq.ref_values is None:
                        riding += len(seq.prompt)
                        seq.rides_prefix = True
                seq.metrics.cached_tokens = seq.prefix_len if seq.prefix_hit else 0
            else:
                own = total
                if not cache.evict_for(own):
                    break
            self._start(self.waiting.popleft(), entry, own, now)
            n_admitted += 1
            if seq.wants_prefill_chunk():  # no image, or its prefix is ready
                admitted.append((seq, seq.next_chunk(budget.take(len(seq.prompt)))))
        if new_prefixes:
            handle = self.rt.launch_prefixes(
                [
                    self.inputs.prefix_job(e, s, pages.pages_for(s.prefill_len))
                    for e, s in new_prefixes
                ],
                partitioned=self._streaming(),
                interactive=interactive_lane,
            )
            for entry, _ in new_prefixes:
                entry.pending = handle
                entry.interactive_lane = interactive_lane
                self.pending_prefixes.append(entry)
            if background_batch:
                self.headroom.launched_batch(new_prefixes[0][0])
                self.lane_batches_since_background = 0
            elif interactive_lane:
                self.lane_batches_since_background += 1
        return admitted

    def _start(self, seq: Sequence, entry: PrefixEntry | None, own: int, now: float) -> None:
        """Give an admitted sequence its ``own`` pages (after the prefix's), a row and its
        row constants, and start its prefill."""
        pages = self.pages
        seq.prefix = entry
        seq.own_pages = pages.allocate(own)
        seq.row = self.free_rows.pop()
        pages.assign(seq.row, (entry.full_pages if entry else []) + seq.own_pages)
        self._set_row_constants(seq)
        self.running.append(seq)
        self.headroom.started(seq.request)
        seq.state = SeqState.PREFILL
        seq.prefill_launched_at = now
        seq.metrics.queue_wait_ms = (now - seq.submitted_at) * 1e3
        if seq.rides_prefix:  # the prefix batch writes its pages: a reference until done
            seq.prefill_launched = len(seq.prompt)
            seq.held = True
            seq.add_ref()
        if seq.request.deadline is not None:
            self._next_deadline = min(self._next_deadline, seq.request.deadline)

    def _streaming(self) -> bool:
        """Whether a running request still has ``prefill_sms_when_streaming`` tokens or more
        to stream: new images then run in the SM partition, so they do not stretch its
        inter-token gaps (no threshold: always)."""
        least = self.cfg.prefill_sms_when_streaming
        if not least:
            return True
        return any(
            s.state is SeqState.RUNNING and s.max_decode - s.decode_launched >= least
            for s in self.running
        )


def _riding(s: Sequence) -> bool:
    """A prompt riding its image prefix's batch, still on the device, its sample held."""
    return s.rides_prefix and s.held and s.cancelled is None
