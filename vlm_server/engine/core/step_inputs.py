"""What the device reads of one launched step, as values (CUDA-free).

The scheduler builds a `StepInputs` when it launches a step and hands it to the runtime
(core/runtime_protocol.py); the device layer reads nothing else of the step's sequences. Every
field is copied out of the sequences at launch (fresh read-only arrays, tuples), so the work the
runtime enqueues cannot see a sequence move on under it: its next chunk planned, its row or
pages handed to another request.

    n_decode       decode rows first, then one row per prompt chunk (core/step_plan.py)
    rows           [B] int64   each step row's block-table row
    adapter_slots  [B] int32   each step row's adapter slot (-1: none)
    tokens, last   the step's token layout (core/step_plan.py's `pack_tokens`)
    block_rows     block-table rows changed since the last launch (ascending), uploaded first
    tails          (source, destination) pages: a prefix's partly filled last page copied into
                   the first own page of a prompt continuing it
    prefix_pages   pages of the image prefixes a prompt's first chunk reads (the fake device's
                   access lists)
    ref_rows       rows whose tokens in this step may read spatial-reference slots
    ref_writes     (row, values) of references encoded before the forward (a prompt's first
                   chunk)

A decode-only step is the same value with no chunks: ``tokens`` then holds one token per row
(its input is on the device) and ``last`` is each row's index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vlm_server.engine.core.prefix_jobs import PrefixJob, PrefixPrompt
from vlm_server.engine.core.step_plan import (
    DEVICE_INPUT,
    N_TOK,
    T_ID,
    T_POS,
    T_ROW,
    StepPlan,
    pack_tokens,
)

if TYPE_CHECKING:
    from vlm_server.engine.core.prefix_cache import PrefixEntry
    from vlm_server.engine.core.sequence import Sequence


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy)."""
    view = a.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One launched step's rows and what its device work reads (see the module docstring)."""

    n_decode: int
    rows: np.ndarray
    adapter_slots: np.ndarray
    tokens: np.ndarray
    last: np.ndarray
    block_rows: tuple[int, ...] = ()
    tails: tuple[tuple[int, int], ...] = ()
    prefix_pages: tuple[int, ...] = ()
    ref_rows: tuple[int, ...] = ()
    ref_writes: tuple[tuple[int, np.ndarray], ...] = ()

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def uses_adapters(self) -> bool:
        """Whether a row of the step uses an adapter (host numpy: no device sync)."""
        return bool((self.adapter_slots >= 0).any())


class LaunchInputs:
    """Builds the values each launch hands the runtime from the scheduler's sequences: a step's
    `StepInputs`, a new image prefix's `PrefixJob` (core/prefix_jobs.py).

    Each row's adapter slot is a row constant, written when a sequence takes the row (the row
    is reused only after its sequence was released), so a step's slots are one gather instead
    of a pass over its sequences."""

    def __init__(self, rows: int) -> None:
        self.adapter_slot = np.full(rows, -1, np.int32)
        self._index = _frozen(np.arange(rows, dtype=np.int64))  # a decode step's ``last``

    def admit(self, row: int, adapter_slot: int) -> None:
        """A sequence took ``row``: its adapter slot (-1: none) until the row is reused."""
        self.adapter_slot[row] = adapter_slot

    def decode(self, seqs: list[Sequence], block_rows: list[int]) -> StepInputs:
        """A decode-only step of ``seqs`` (row order = batch order): `pack_tokens`' layout of
        decode rows, without its plan (this runs every step)."""
        b = len(seqs)
        tokens = np.empty((b, N_TOK), np.int64)
        tokens[:, T_ROW] = np.fromiter((s.row for s in seqs), np.int64, b)
        tokens[:, T_POS] = np.fromiter((s.next_position() for s in seqs), np.int64, b)
        tokens[:, T_ID] = DEVICE_INPUT
        tokens.flags.writeable = False  # and so the views taken of it
        rows = tokens[:, T_ROW]
        slots = self.adapter_slot.take(rows)
        slots.flags.writeable = False
        return StepInputs(b, rows, slots, tokens, self._index[:b], tuple(block_rows))

    def mixed(self, seqs: list[Sequence], plan: StepPlan, block_rows: list[int]) -> StepInputs:
        """A mixed step: ``plan``'s decode rows and chunks over ``seqs`` (step-row order)."""
        tokens, last = pack_tokens(seqs, plan)
        d = plan.n_decode
        rows = np.empty(plan.n_rows, np.int64)
        rows[:d] = tokens[:d, T_ROW]
        tails: list[tuple[int, int]] = []
        prefix_pages: list[int] = []
        ref_rows: list[int] = []
        ref_writes: list[tuple[int, np.ndarray]] = []
        for i, chunk in enumerate(plan.chunks, start=d):
            seq = seqs[i]
            row = rows[i] = seq.row
            refs = seq.ref_values
            if chunk.length and refs is not None:
                ref_rows.append(row)
                if chunk.start == 0:  # its references' embeddings, before its first forward
                    ref_writes.append((row, _frozen(refs)))
            prefix = seq.prefix
            if chunk.start == 0 and prefix is not None:
                prefix_pages += prefix.pages  # written on the prefill stream: read only if ready
                if prefix.tail_page is not None:
                    # The prompt continues the prefix's partly filled last page: a private copy.
                    tails.append((prefix.tail_page, seq.own_pages[0]))
        return StepInputs(
            d,
            rows,
            self._seal(rows, tokens, last),
            tokens,
            last,
            tuple(block_rows),
            tuple(tails),
            tuple(prefix_pages),
            tuple(ref_rows),
            tuple(ref_writes),
        )

    def prefix_job(self, entry: PrefixEntry, seq: Sequence, prompt_pages: int) -> PrefixJob:
        """The job computing ``entry``, the new image prefix of ``seq``, with ``seq``'s prompt
        if it rides along (its first ``prompt_pages`` pages: up to its prompt's end)."""
        prompt = None
        if seq.rides_prefix:
            pages = (*entry.full_pages, *seq.own_pages)[:prompt_pages]
            prompt = PrefixPrompt(seq.row, seq.prompt_ids, pages)
        return PrefixJob(tuple(entry.pages), seq.request.image, prompt, seq.adapter_slot)

    def _seal(self, rows: np.ndarray, *arrays: np.ndarray) -> np.ndarray:
        """The adapter slots of ``rows``; those, ``rows`` and ``arrays`` made read-only."""
        slots = self.adapter_slot.take(rows)
        for a in (rows, slots, *arrays):
            a.flags.writeable = False
        return slots
