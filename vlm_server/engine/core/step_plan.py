"""Planning one mixed step: decode rows plus prefill chunks under a per-step token budget.

A mixed step is one forward over a ragged token batch. Its rows, in this order:

    decode rows (one token each, input read on the device) | prefill chunks (prompt tokens)

`StepBudget` decides how many prompt tokens each prefill gets, first come first served: every
decode row is always in (the budget is at least ``max_batch_size + 1``, see EngineConfig), then the
oldest prefill takes what is left, then the next one, until the budget is spent. A prompt
longer than what is left is split across steps (chunked prefill), so admitting a request never
stalls running streams by more than one step.

An image prefix (BOS + image patches) is not part of any step: the scheduler starts it on
the device's prefill stream when it admits the prefix's first user, and that user's prompt
chunks join steps once the prefix is ready (core/prefix_cache.py), so a new image never
lengthens a step. A short prompt may instead ride its prefix's forward (core/prefix_jobs.py):
its row in a step then holds no token (a zero-length final chunk, `Chunk.held`) and samples
the hidden state that forward kept.

`pack_tokens` turns a plan into the per-token layout the runtime uploads in one copy:

    tokens [T, 3] int64: block-table row | position | token id (-1: the row's next input,
                         written on the device by the previous finalize)
    last   [B]    int64: index in the token batch of each step row's last token (its
                         hidden state is what finalize samples from), -1 when the row has
                         no token in this step; ``HELD - row`` for a row whose prompt ran
                         with its image prefix (core/prefix_jobs.py): it samples the hidden
                         state held on the device at its block-table row

Invariants (tests/test_step_plan.py checks them under hypothesis):
  B1 the tokens of a step (decode rows + chunks) never exceed the budget;
  B2 every decode row is included; B3 the oldest waiting prefill always progresses;
  B4 chunks are contiguous and in prompt order, taken FIFO across prefills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

T_ROW, T_POS, T_ID = range(3)
N_TOK = 3
DEVICE_INPUT = -1  # token id of a decode row: its input embedding is already on the device
HELD = -2  # ``last`` of a held row is HELD - its block-table row (see the module docstring)


class StepBudget:
    """The token budget of one step, handed out to prefills in arrival order."""

    def __init__(self, budget: int, n_decode: int) -> None:
        if n_decode >= budget:
            raise ValueError(f"{n_decode} decode rows leave no room in a budget of {budget}")
        self.budget = budget
        self.tokens = n_decode  # token rows planned so far (B1 bounds this)

    @classmethod
    def spent(cls) -> StepBudget:
        """A budget with nothing left (admission outside a step: new pictures only)."""
        budget = cls(1, 0)
        budget.tokens = 1
        return budget

    @property
    def left(self) -> int:
        return self.budget - self.tokens

    def can_take(self) -> bool:
        """Whether the next prefill gets any token in this step."""
        return self.left > 0

    def take(self, remaining: int) -> int:
        """Prompt tokens the next prefill launches in this step; call only after `can_take`
        said yes."""
        if remaining < 1:
            raise ValueError("a prefill with nothing left to launch")
        if not self.can_take():
            raise ValueError("the step's budget is spent")
        n = min(remaining, self.left)
        self.tokens += n
        return n


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens ``[start, start + length)`` of one sequence, launched in one step."""

    start: int
    length: int
    final: bool  # the prompt's last token is in it: the row samples its first output

    @classmethod
    def held(cls, prompt_len: int) -> Chunk:
        """The row of a prompt that ran with its image prefix: no token, samples the first
        output from the held hidden state."""
        return cls(prompt_len, 0, True)


@dataclass
class StepPlan:
    """The rows of one mixed step: ``n_decode`` decode rows, then one row per chunk."""

    n_decode: int
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def n_rows(self) -> int:
        return self.n_decode + len(self.chunks)

    @property
    def n_tokens(self) -> int:
        return self.n_decode + sum(c.length for c in self.chunks)

    def samples(self, i: int) -> bool:
        """Whether step row ``i`` samples an output: decode rows and final chunks do."""
        return i < self.n_decode or self.chunks[i - self.n_decode].final

    def ends_prefill(self, i: int) -> bool:
        """Whether step row ``i`` is the last chunk of its sequence's prefill."""
        return i >= self.n_decode and self.chunks[i - self.n_decode].final


class TokenSource(Protocol):
    """What packing needs of a sequence."""

    row: int
    prefix_len: int

    @property
    def prompt_ids(self) -> np.ndarray:
        """The prompt as int64 (chunks are copied from it, not converted token by token)."""
        ...

    def next_position(self) -> int: ...


def pack_tokens(
    seqs: Sequence[TokenSource], plan: StepPlan, positions: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The per-token layout of ``plan`` over ``seqs`` (step-row order), see the module
    docstring. ``positions`` gives each decode row's position (default: its next one)."""
    if len(seqs) != plan.n_rows:
        raise ValueError(f"{len(seqs)} sequences for a plan of {plan.n_rows} rows")
    tokens = np.empty((plan.n_tokens, N_TOK), np.int64)
    last = np.empty(plan.n_rows, np.int64)
    d = plan.n_decode
    if d:
        dec = seqs[:d]
        tokens[:d, T_ROW] = np.fromiter([s.row for s in dec], np.int64, d)
        if positions is None:
            positions = np.fromiter([s.next_position() for s in dec], np.int64, d)
        tokens[:d, T_POS] = positions
        tokens[:d, T_ID] = DEVICE_INPUT
        last[:d] = np.arange(d)
    at = d
    for i, chunk in enumerate(plan.chunks, start=d):
        n = chunk.length
        seq = seqs[i]
        if not n:
            last[i] = HELD - seq.row if chunk.final else -1
            continue
        end = at + n
        first = seq.prefix_len + chunk.start
        block = tokens[at:end]
        block[:, T_ROW] = seq.row
        block[:, T_POS] = np.arange(first, first + n)
        block[:, T_ID] = seq.prompt_ids[chunk.start : chunk.start + n]
        last[i] = end - 1
        at = end
    return tokens, last
