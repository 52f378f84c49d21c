"""CUDA-free state of the two-slot pipeline: which slot holds which step, in launch order.

Timing (depth 2, steady state; one compute stream, host below):

    GPU   | fwd t | sample t | fwd t+1 | sample t+1 | fwd t+2 ...
    host  | commit t-1, finalize t, launch t+1 | commit t, finalize t+1, launch t+2 ...

A step moves LAUNCHED -> FINALIZED (masks uploaded, sampling enqueued) -> COMMITTING (its
results are being read on the host) -> its slot is FREE again.

Invariants (every illegal transition raises):
  I2 steps are committed in launch order (FIFO);
  I5 a slot is reused only after the commit that read its host buffers completed;
  at most ``depth`` steps are in flight; a step is finalized before it is committed.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from vlm_server.engine.core.step_plan import StepPlan


class LaunchKind(enum.Enum):
    """What a pipeline step's forward does (not to be confused with a grammar's step kind)."""

    MIXED = "mixed"  # decode rows plus prefill chunks in one ragged forward (core/step_plan.py)
    DECODE = "decode"  # decode rows only: the graphed path on CUDA


class SequenceLike(Protocol):
    """What the pipeline needs of a sequence: its batch row and in-flight reference count."""

    row: int
    inflight_refs: int


S = TypeVar("S", bound=SequenceLike)


class SlotState(enum.Enum):
    FREE = "free"
    LAUNCHED = "launched"
    FINALIZED = "finalized"
    COMMITTING = "committing"


class PipelineError(RuntimeError):
    """An illegal pipeline transition: always a scheduler bug."""


@dataclass
class Step(Generic[S]):
    step_id: int
    slot: int
    kind: LaunchKind
    seqs: list[S]  # the sequences in batch-row order
    state: SlotState = SlotState.LAUNCHED
    # A mixed step's rows and chunks; None for a decode-only step.
    plan: StepPlan | None = None
    # Per-row phase (a `RowPhase` value) that finalize chose; commit reads it back.
    phases: list[int] = field(default_factory=list)
    regions: bool = False  # some row decodes region values (finalize sets it, commit reads)


class PipelineState(Generic[S]):
    def __init__(self, depth: int, n_slots: int = 2) -> None:
        if depth not in (1, 2):
            raise ValueError("pipeline depth must be 1 (blocking) or 2 (pipelined)")
        if n_slots < depth:
            raise ValueError("need at least as many slots as the pipeline depth")
        self.depth = depth
        self.slots: list[Step[S] | None] = [None] * n_slots
        self.in_flight: deque[Step[S]] = deque()
        self._next_id = 0

    @property
    def n_in_flight(self) -> int:
        return len(self.in_flight)

    def can_launch(self) -> bool:
        return len(self.in_flight) < self.depth and self.free_slot() is not None

    def free_slot(self) -> int | None:
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        return None

    def launch(self, kind: LaunchKind, seqs: list[S], plan: StepPlan | None = None) -> Step[S]:
        if len(self.in_flight) >= self.depth:
            raise PipelineError(
                f"launch with {len(self.in_flight)} steps in flight at depth {self.depth}"
            )
        slot = self.free_slot()
        if slot is None:
            raise PipelineError("launch with no free slot")
        if (plan is None) != (kind is LaunchKind.DECODE) or (plan and plan.n_rows != len(seqs)):
            raise PipelineError("a mixed step needs a plan of its rows, a decode step none")
        step = Step(self._next_id, slot, kind, seqs, plan=plan)
        self._next_id += 1
        self.slots[slot] = step
        self.in_flight.append(step)
        return step

    def unfinalized(self) -> Step[S] | None:
        """The newest step still waiting for its finalize (at most one can be)."""
        for step in self.in_flight:
            if step.state is SlotState.LAUNCHED:
                return step
        return None

    def mark_finalized(self, step: Step[S]) -> None:
        if step.state is not SlotState.LAUNCHED:
            raise PipelineError(f"finalize of step {step.step_id} in state {step.state}")
        if any(s.state is SlotState.LAUNCHED for s in self.in_flight if s.step_id < step.step_id):
            raise PipelineError("finalize out of launch order")
        step.state = SlotState.FINALIZED

    def pop_oldest(self) -> Step[S]:
        """Take the oldest step for commit; its slot stays reserved until `complete`."""
        if not self.in_flight:
            raise PipelineError("commit with nothing in flight")
        step = self.in_flight[0]
        if step.state is not SlotState.FINALIZED:
            raise PipelineError(f"commit of step {step.step_id} before its finalize")
        self.in_flight.popleft()
        step.state = SlotState.COMMITTING
        return step

    def complete(self, step: Step[S]) -> None:
        """The commit finished reading the slot's host buffers: the slot is free again."""
        if step.state is not SlotState.COMMITTING or self.slots[step.slot] is not step:
            raise PipelineError(f"complete of step {step.step_id} in state {step.state}")
        self.slots[step.slot] = None
        step.state = SlotState.FREE
