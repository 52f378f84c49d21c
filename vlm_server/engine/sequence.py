"""One request's host-side state in the engine (CUDA-free).

Lifecycle: WAITING -> PREFILL (prefill launched) -> RUNNING (first output sampled on device)
-> FINISHED (result delivered; may still be a zombie in flight) -> RELEASED (pages and row
returned once ``inflight_refs`` is 0).

Invariants: I4 0 <= inflight_refs <= 2; I6 pages are released only when the sequence is
finished and inflight_refs is 0; a finished sequence's later commits append nothing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decoding.detokenize import StreamDetokenizer
from decoding.grammars import Grammar, StepKind
from vlm_server.engine.api import GenerationRequest, RequestMetrics
from vlm_server.engine.prefix_cache import PrefixEntry


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"
    RELEASED = "released"


# Per-row phase codes shared with the runtime's finalize (what the step's output is and which
# embedding becomes the sequence's next input).
PHASE_TOKEN = 0  # sample a token; it is the next input
PHASE_BOUNDARY = 1  # sample a token (eos or not) and decode x; next input is x's embedding
PHASE_COORD = 2  # decode y; next input is its embedding
PHASE_SIZE = 3  # decode (w, h); next input is its embedding
PHASE_IDLE = 4  # zombie or finished row: outputs are ignored


@dataclass
class Sequence:
    request: GenerationRequest
    prompt: list[int]
    grammar: Grammar
    prefix_len: int  # 0 (text only, BOS in the prompt) or BOS + image patches
    detok: StreamDetokenizer | None = None
    emit: Callable[[object], None] | None = None  # delivers events to the request's stream
    # Gives back what the request holds outside the engine (a constraint's mask-table rows);
    # called once, when no in-flight step can read them any more.
    on_release: Callable[[], None] | None = None
    state: SeqState = SeqState.WAITING
    row: int = -1
    own_pages: list[int] = field(default_factory=list)
    prefix: PrefixEntry | None = None
    prefix_hit: bool = False
    inflight_refs: int = 0
    decode_launched: int = 0  # decode steps launched so far
    cancelled: str | None = None  # reason code when cancelled (CANCELLED / DEADLINE_EXCEEDED)
    text_parts: list[str] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    submitted_at: float = field(default_factory=time.monotonic)
    prefill_launched_at: float = 0.0
    first_token_at: float = 0.0

    @property
    def prefill_len(self) -> int:
        """Positions written by the prefill: prefix plus prompt."""
        return self.prefix_len + len(self.prompt)

    @property
    def total_positions(self) -> int:
        return self.prefill_len + self.grammar.max_positions

    @property
    def finished(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.RELEASED)

    def wants_decode_step(self) -> bool:
        """Whether another decode step may be launched for this sequence now.

        Launches run ahead of commits, so this is an upper bound: the grammar's position budget
        caps the steps, and a finished sequence launches nothing.
        """
        return (
            self.state is SeqState.RUNNING
            and self.cancelled is None
            and self.decode_launched < self.grammar.max_positions
        )

    def next_position(self) -> int:
        return self.prefill_len + self.decode_launched

    def phase(self) -> int:
        """The phase of the step about to be finalized, from the committed grammar state."""
        if self.finished or self.cancelled is not None:
            return PHASE_IDLE
        kind = self.grammar.next_kind
        if kind is StepKind.TOKEN:
            return PHASE_TOKEN if self.grammar.feeds_token else PHASE_BOUNDARY
        if kind is StepKind.COORD_Y:
            return PHASE_COORD
        if kind is StepKind.SIZE:
            return PHASE_SIZE
        return PHASE_IDLE

    def release_resources(self) -> None:
        """Run `on_release` once (idempotent)."""
        release, self.on_release = self.on_release, None
        if release is not None:
            release()

    def add_ref(self) -> None:
        if self.inflight_refs >= 2:
            raise AssertionError(f"sequence {self.request.request_id} in more than 2 steps")
        self.inflight_refs += 1

    def drop_ref(self) -> None:
        if self.inflight_refs <= 0:
            raise AssertionError("inflight_refs below zero")
        self.inflight_refs -= 1
