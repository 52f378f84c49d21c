"""Per-request grammar state: what the next step is, its mask row, and the commit of its result.

Protocol, per request and decode step (host side, after the step's results reached the host):

  before sampling step t (state committed through t-1):
    kind = g.next_kind          TOKEN, REASON, COORD_Y or SIZE (COORD_X never: see below),
                                DONE
    row  = g.mask_row           table row for a TOKEN step (NO_MASK: no constraint, and for
                                every step that samples no token)
    g.feeds_token               whether the sampled token is the next input. False at an object
                                boundary: there the device also decodes x from the SAME hidden
                                state and the next input is the coordinate embedding of x.
  after step t (commit):
    TOKEN    g.advance_token(id); if g.next_kind is COORD_X, then g.advance_value(x) with the x
             decoded from step t's hidden state.
    REASON   g.advance_token(id); if g.next_kind is COORD_X (the coordinate token), then
             g.advance_value(x) with the x decoded from step t's hidden state
             (decoding/reasoning_grammar.py).
    COORD_Y  g.advance_value(y)
    SIZE     g.advance_value((w, h))
  g.finished: no further step is needed (eos sampled, or the grammar or the budget allows
  nothing but eos: the grammar then finishes without spending a step on eos).

Every commit is O(1) in the vocabulary (a few list lookups, a walk over one token's bytes).

Budgets: `max_tokens` counts generated tokens other than eos, like the reference loop;
`max_objects` caps point/detect; segment paths also cap their points. When a budget runs out the
grammar closes the answer validly; a finished answer always parses.
"""

from __future__ import annotations

from typing import Protocol

from .grammar_base import GrammarEnd, GrammarError, StepKind
from .reasoning_grammar import ReasoningGrammar, ReasoningRows, ReasoningTokens
from .region_grammars import (
    ObjectGrammar,
    PathRows,
    RegionRows,
    RegionTokens,
    SegmentGrammar,
    detect_grammar,
    point_grammar,
)
from .svg_segment_grammar import SvgTokenRows, SvgTokenSegmentGrammar
from .text_grammar import TextGrammar

__all__ = [
    "Grammar",
    "GrammarEnd",
    "GrammarError",
    "ObjectGrammar",
    "PathRows",
    "ReasoningGrammar",
    "ReasoningRows",
    "ReasoningTokens",
    "RegionRows",
    "RegionTokens",
    "SegmentGrammar",
    "StepKind",
    "SvgTokenRows",
    "SvgTokenSegmentGrammar",
    "TextGrammar",
    "detect_grammar",
    "point_grammar",
]


class Grammar(Protocol):
    """What the engine sees of a request's grammar (every grammar here conforms)."""

    next_kind: StepKind
    finish_reason: GrammarEnd | None

    @property
    def finished(self) -> bool: ...

    @property
    def mask_row(self) -> int: ...

    @property
    def feeds_token(self) -> bool: ...

    @property
    def max_positions(self) -> int: ...

    def advance_token(self, token_id: int) -> None: ...

    def advance_value(self, value: object) -> None: ...
