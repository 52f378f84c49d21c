"""One request's host-side state in the engine (CUDA-free).

Lifecycle: WAITING -> PREFILL (admitted: its prompt is launched chunk by chunk, over one or more
mixed steps, or with its image's new prefix, core/prefix_jobs.py) -> RUNNING (the step holding
its last prompt chunk, or its held row, sampled its first output) -> FINISHED (result
delivered; may still be a zombie in flight) -> RELEASED (pages and row returned once
``inflight_refs`` is 0).

Invariants: I4 0 <= inflight_refs <= 2 (a prompt riding its image prefix holds one reference
until the prefix batch completed: the prefill stream writes its pages); I6 pages are released
only when the sequence is finished and inflight_refs is 0; a finished sequence's later commits
append nothing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from decoding.grammars import Grammar, ReasoningGrammar, StepKind, TextGrammar
from decoding.mask_table import NO_MASK
from vlm_server.engine.api import Emitted, ErrorCode, GenerationRequest, RequestMetrics
from vlm_server.engine.core.outputs import Output, output_for
from vlm_server.engine.core.prefix_cache import PrefixEntry
from vlm_server.engine.core.step_layout import SAMPLING_PHASES, RowPhase
from vlm_server.engine.core.step_plan import Chunk


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"
    RELEASED = "released"


# eq=False: sequences are compared by identity, so the scheduler's `in` / `remove` on its lists
# scan pointers instead of calling a generated field-by-field __eq__ per element.
_DONE = (SeqState.FINISHED, SeqState.RELEASED)
_TOKEN_STEP, _COORD_Y_STEP, _SIZE_STEP = StepKind.TOKEN, StepKind.COORD_Y, StepKind.SIZE
_REASON_STEP = StepKind.REASON
_TOKEN, _BOUNDARY, _REASON, _COORD, _SIZE, _IDLE = (
    RowPhase.TOKEN,
    RowPhase.BOUNDARY,
    RowPhase.REASON,
    RowPhase.COORD,
    RowPhase.SIZE,
    RowPhase.IDLE,
)
_LAST_SAMPLING = max(SAMPLING_PHASES)  # the sampling phases are the lowest values
# Grammars whose sampled tokens are text (sampled at the request's temperature, counted by
# their `token_ids` for the sampler's step counter).
_TEXT_GRAMMARS = (TextGrammar, ReasoningGrammar)


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    prompt: list[int]
    grammar: Grammar
    prefix_len: int  # 0 (text only, BOS in the prompt) or BOS + image patches
    # How its committed rows become its events (core/outputs.py). None: `output_for` its
    # grammar, without a vocabulary (text then streams nothing).
    output: Output = None  # type: ignore[assignment]
    emit: Callable[[Emitted], None] | None = None  # delivers events to the request's stream
    # Gives back what the request holds outside the engine (a constraint's mask-table rows);
    # called once, when no in-flight step can read them any more.
    on_release: Callable[[], None] | None = None
    # What its prompt's spatial-reference placeholders encode (engine/requests/spatial.py).
    ref_values: np.ndarray | None = None
    state: SeqState = SeqState.WAITING
    row: int = -1
    adapter_slot: int = -1  # the device slot of its adapter, pinned for it (-1: none)
    own_pages: list[int] = field(default_factory=list)
    prefix: PrefixEntry | None = None
    prefix_hit: bool = False
    inflight_refs: int = 0
    prefill_launched: int = 0  # prompt tokens whose chunk was launched so far
    decode_launched: int = 0  # decode steps launched so far
    # The prompt runs with its image's new prefix (core/prefix_jobs.py): True while that batch
    # is on the device (and holds a reference), `held` until a step sampled the first output.
    rides_prefix: bool = False
    held: bool = False
    cancelled: ErrorCode | None = None  # CANCELLED or DEADLINE_EXCEEDED once asked to stop
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    submitted_at: float = field(default_factory=time.monotonic)
    prefill_launched_at: float = 0.0
    # Fixed by the grammar at construction; read every step, so kept as plain attributes.
    is_text: bool = field(init=False)
    max_decode: int = field(init=False)  # the grammar's position budget
    # The prompt as int64, made where the sequence is built (not on the scheduler thread):
    # prefill chunks are copied from it.
    prompt_ids: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.output is None:
            self.output = output_for(self.grammar)
        self.output.clip = self.request.clip
        self.is_text = isinstance(self.grammar, _TEXT_GRAMMARS)
        self.max_decode = self.grammar.max_positions
        self.prompt_ids = np.asarray(self.prompt, np.int64)
        self.prompt_ids.flags.writeable = False

    @property
    def prefill_len(self) -> int:
        """Positions written by the prefill: prefix plus prompt."""
        return self.prefix_len + len(self.prompt)

    @property
    def total_positions(self) -> int:
        return self.prefill_len + self.grammar.max_positions

    @property
    def finished(self) -> bool:
        return self.state in _DONE

    def wants_decode_step(self) -> bool:
        """Whether another decode step may be launched for this sequence now.

        Launches run ahead of commits, so this is an upper bound: the grammar's position budget
        caps the steps, and a finished sequence launches nothing.
        """
        return (
            self.state is SeqState.RUNNING
            and self.cancelled is None
            and self.decode_launched < self.max_decode
        )

    def wants_prefill_chunk(self) -> bool:
        """Whether an admitted sequence still has prompt tokens to launch (once its image
        prefix, if any, is on the device)."""
        return (
            self.state is SeqState.PREFILL
            and self.cancelled is None
            and self.prefill_launched < len(self.prompt)
            and (self.prefix is None or self.prefix.ready)
        )

    def wants_held_sample(self) -> bool:
        """Whether a prompt that ran with its image prefix (now ready) waits for the step that
        samples its first output."""
        return (
            self.held
            and not self.rides_prefix
            and self.state is SeqState.PREFILL
            and self.cancelled is None
        )

    def next_position(self) -> int:
        return self.prefix_len + len(self.prompt) + self.decode_launched

    def phase(self) -> RowPhase:
        """The phase of the step about to be finalized, from the committed grammar state."""
        # Called per row every step: module constants, not enum attribute lookups.
        if self.state in _DONE or self.cancelled is not None:
            return _IDLE
        g = self.grammar
        kind = g.next_kind
        if kind is _TOKEN_STEP:
            return _TOKEN if g.feeds_token else _BOUNDARY
        if kind is _COORD_Y_STEP:
            return _COORD
        if kind is _SIZE_STEP:
            return _SIZE
        if kind is _REASON_STEP:
            return _REASON
        return _IDLE

    def row_state(self, samples: bool) -> tuple[int, int, RowPhase, int]:
        """(row, mask row, phase, sampled-token count) for the step being finalized, from
        the committed state; ``samples`` is False for a chunk that does not end its prompt."""
        g = self.grammar
        phase = self.phase() if samples else _IDLE
        # Only the phases that sample a token are masked.
        mask = g.mask_row if phase <= _LAST_SAMPLING else NO_MASK
        return self.row, mask, phase, len(g.token_ids) if self.is_text else 0  # type: ignore[attr-defined]

    def release_resources(self) -> None:
        """Run `on_release` once (idempotent)."""
        release, self.on_release = self.on_release, None
        if release is not None:
            release()

    def add_ref(self) -> None:
        if self.inflight_refs >= 2:
            raise AssertionError(f"sequence {self.request.request_id} in more than 2 steps")
        self.inflight_refs += 1

    def next_chunk(self, length: int) -> Chunk:
        """The prompt's next ``length`` tokens, from where its launched chunks end."""
        start = self.prefill_launched
        return Chunk(start, length, start + length == len(self.prompt))

    def prefill_ended(self, now: float) -> None:
        """A step ran the prompt's last chunk (or its held row): the prefill metrics."""
        m = self.metrics
        m.prefill_ms = (now - self.prefill_launched_at) * 1e3
        if self.prefix is not None and not self.prefix_hit and not m.prefix_wait_ms:
            # Its held row ran behind its prefix on the device: done by now.
            m.prefix_wait_ms = m.prefill_ms

    def drop_ref(self) -> None:
        if self.inflight_refs <= 0:
            raise AssertionError("inflight_refs below zero")
        self.inflight_refs -= 1
