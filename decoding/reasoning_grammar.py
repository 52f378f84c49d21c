"""Grounded reasoning: a query thinks in text, grounding it with points, then answers.

The protocol of the reference (moondream2's query with ``reasoning=True``):

- The prompt ends with the answer marker and the thinking marker; reasoning tokens follow.
- A reasoning token is fed back, except the coordinate token: its x is decoded from the same
  hidden state that chose it, and x's embedding is the next input (StepKind.REASON).
- After the first reasoning token, the contract's suppressed ids are never sampled (Moondream
  2: eos and the size token; Moondream 3: none).
- The answer marker ends the reasoning and is fed back (the reference prefills it), then the
  answer follows as free or constrained text (`TextGrammar`).
- ``start_ground_points_id`` and ``end_ground_id`` each open a new span of the reasoning; the
  coordinates of a span pair up into its grounding points.

Budgets, as the reference gives them: ``max_tokens`` bounds the reasoning, and again the answer
(the answer marker is counted in neither). A reasoning that spends its budget gets the answer
marker (only it may be sampled next, where the reference prefills it), then its answer. Both
phases also stop at the model's context (``room``): there the reasoning yields early enough for
the shortest answer (``reserve``, at least one token) to fit, and the answer ends at the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .grammar_base import GrammarBase, GrammarError, StepKind, coordinate_value
from .mask_table import NO_MASK, MaskTable
from .text_grammar import TextGrammar

_TOKEN, _COORD_X, _REASON = StepKind.TOKEN, StepKind.COORD_X, StepKind.REASON


@dataclass(frozen=True)
class ReasoningTokens:
    """The ids the reasoning protocol reads."""

    eos_id: int
    answer_id: int
    coord_id: int
    size_id: int
    start_ground_points_id: int
    end_ground_id: int
    # Masked out of every reasoning step after the first (Moondream 2: eos and the size token).
    suppressed: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReasoningRows:
    """The pinned mask rows of reasoning, registered once per table."""

    tokens: ReasoningTokens
    thinking: int  # every step after the first: the suppressed ids masked out
    to_answer: int  # the reasoning budget is spent: only the answer marker

    @classmethod
    def register(cls, table: MaskTable, tokens: ReasoningTokens) -> ReasoningRows:
        suppressed = list(tokens.suppressed)
        return cls(
            tokens,
            table.allow_all_but(suppressed) if suppressed else NO_MASK,
            table.allow_only([tokens.answer_id]),
        )


@dataclass(frozen=True)
class ReasoningSpan:
    """Reasoning tokens [start, end) of one span and the coordinates decoded inside it."""

    start: int
    end: int
    coords: tuple[float, ...]


class ReasoningGrammar(GrammarBase):
    """Reasoning text with grounding coordinates, then the answer (made by ``answer`` with
    its budget: ``max_tokens``, or what the context leaves). ``token_ids`` holds every sampled
    token (reasoning, the answer marker, the answer): the sampler's step counter."""

    def __init__(
        self,
        rows: ReasoningRows,
        max_tokens: int,
        answer: Callable[[int], TextGrammar],
        reserve: int = 0,
        room: int | None = None,
    ) -> None:
        """``reserve``: the shortest answer's tokens (a constrained answer's); ``room``: the
        positions the context leaves after the prompt (None: only the budgets bound it)."""
        super().__init__()
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if reserve > max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is too small: the answer needs at least {reserve}"
            )
        positions = 2 * max_tokens + 1  # both budgets and the answer marker
        if room is not None:
            if room < reserve + 1:
                raise ValueError(
                    f"the context leaves {room} positions: the answer needs {reserve + 1}"
                )
            positions = min(positions, room)
        self._rows = rows
        self._max_tokens = max_tokens
        self._positions = positions
        # Reasoning tokens allowed: the budget, unless the context must keep the marker and
        # the shortest answer (never empty) after them.
        self._limit = min(max_tokens, positions - 1 - max(reserve, 1))
        self._make_answer = answer
        self.answer: TextGrammar | None = None
        self.token_ids: list[int] = []
        self.reasoning_ids: list[int] = []
        self._span_starts: list[int] = [0]
        self._coords: list[list[float]] = [[]]
        self.next_kind = _REASON

    # ---- what the engine reads ------------------------------------------------------------

    @property
    def reasoning(self) -> bool:
        """Whether the grammar is still in the reasoning text."""
        return self.answer is None

    @property
    def mask_row(self) -> int:
        if self.answer is not None:
            return self.answer.mask_row
        if self.finished:
            return NO_MASK
        if len(self.reasoning_ids) >= self._limit:
            return self._rows.to_answer
        return self._rows.thinking if self.reasoning_ids else NO_MASK

    @property
    def feeds_token(self) -> bool:
        """Tokens are fed back (the coordinate token's x is the REASON step's business)."""
        return True

    @property
    def max_positions(self) -> int:
        """Both phases' tokens and the answer marker, within the context's room."""
        return self._positions

    @property
    def span_count(self) -> int:
        """Spans opened so far (one at the start)."""
        return len(self._span_starts)

    def spans(self) -> list[ReasoningSpan]:
        """The reasoning's spans so far, in order (the last one still open)."""
        ends = [*self._span_starts[1:], len(self.reasoning_ids)]
        return [
            ReasoningSpan(start, end, tuple(coords))
            for start, end, coords in zip(self._span_starts, ends, self._coords, strict=True)
        ]

    # ---- commits ---------------------------------------------------------------------------

    def advance_token(self, token_id: int) -> None:
        if self.answer is not None:
            self._expect(_TOKEN)
            n = len(self.answer.token_ids)
            self.answer.advance_token(token_id)
            if len(self.answer.token_ids) > n:  # not eos
                self.token_ids.append(token_id)
            self._follow_answer()
            return
        self._expect(_REASON)
        t = self._rows.tokens
        at_limit = len(self.reasoning_ids) >= self._limit
        if at_limit and token_id != t.answer_id:
            raise GrammarError(f"token {token_id} after the reasoning budget was spent")
        if self.reasoning_ids and token_id in t.suppressed:
            raise GrammarError(f"token {token_id} is suppressed while reasoning")
        self.token_ids.append(token_id)
        if token_id == t.answer_id:
            left = self._positions - 1 - len(self.reasoning_ids)
            self.answer = self._make_answer(min(self._max_tokens, left))
            self._follow_answer()
            return
        if token_id in (t.start_ground_points_id, t.end_ground_id):
            self._span_starts.append(len(self.reasoning_ids))
            self._coords.append([])
        self.reasoning_ids.append(token_id)
        if token_id == t.coord_id:
            self.next_kind = _COORD_X

    def advance_value(self, value: object) -> None:
        """The x decoded with a coordinate token."""
        self._expect(_COORD_X)
        self._coords[-1].append(coordinate_value(value))
        self.next_kind = _REASON

    def _follow_answer(self) -> None:
        answer = self.answer
        assert answer is not None
        self.next_kind = answer.next_kind
        self.finish_reason = answer.finish_reason
