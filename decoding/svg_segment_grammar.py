"""Moondream 3's segment: one box, then an SVG path written one item per token.

The box decodes as one detect object does: a boundary token (the coordinate token where the
contract has one; never fed back), x from the same hidden state, y, then the size. The path's
tokens follow and are fed back, masked by the item grammar (svg_token_dfa.py) within
`max_tokens`; eos is allowed only where the path may end, and when the budget leaves nothing
else the grammar ends the path itself, so a finished path always parses.

The path is parsed as it commits: `chunks` holds each completed group of arguments as text,
scaled and box-relative (svg_tokens.py), the first without its joining space, ready to stream;
their concatenation is the whole path. Every commit is O(1) in the vocabulary: one kind byte
walked, one item looked up.
"""

from __future__ import annotations

from dataclasses import dataclass

from .grammar_base import (
    BudgetedWalk,
    GrammarBase,
    GrammarEnd,
    GrammarError,
    StepKind,
    coordinate_value,
    size_value,
)
from .mask_table import NO_MASK, AutomatonRows
from .region_grammars import RegionRows
from .segment_output import SegmentResult
from .svg_geometry import Box, build_box_segment, clamped_box
from .svg_tokens import PathParser

_TOKEN, _COORD_X = StepKind.TOKEN, StepKind.COORD_X
_COORD_Y, _SIZE = StepKind.COORD_Y, StepKind.SIZE


@dataclass(frozen=True)
class SvgTokenRows:
    """The path grammar registered in a mask table, and each token id's item (its stripped
    text alone; None for ids a path never holds)."""

    automaton: AutomatonRows
    items: tuple[str | None, ...]


class SvgTokenSegmentGrammar(GrammarBase):
    """Segment in Moondream 3's language: box, then path tokens, then eos."""

    def __init__(self, rows: RegionRows, path: SvgTokenRows, max_tokens: int) -> None:
        super().__init__()
        self._rows = rows
        self._items = path.items
        self._walk = BudgetedWalk(path.automaton, path.automaton.dfa.start, max_tokens)
        self._max_tokens = max_tokens
        self.in_path = False
        self.center = (0.0, 0.0)
        self.size = (0.0, 0.0)
        self.path_ids: list[int] = []  # the path's tokens, as committed
        self.parser = PathParser()
        self.chunks: list[str] = []

    @property
    def mask_row(self) -> int:
        """Mask row of the next step (NO_MASK when it samples no token)."""
        if self.next_kind is not _TOKEN:
            return NO_MASK
        return self._walk.row() if self.in_path else self._rows.segment_start

    @property
    def feeds_token(self) -> bool:
        """The box's boundary token is not fed back; path tokens are."""
        return self.in_path

    @property
    def max_positions(self) -> int:
        """Upper bound on positions this request feeds after its prompt."""
        return 3 + self._max_tokens

    @property
    def box(self) -> Box:
        """The box as reported: centre plus and minus half the size, clamped to the picture."""
        return clamped_box(self.center, self.size)

    def result(self, image_size: tuple[int, int]) -> SegmentResult:
        """The finished answer for an image of (width, height) pixels: box, image-space path,
        polygons, RLE mask, and the box-relative path."""
        if not self.finished:
            raise GrammarError("segment result asked for before the grammar finished")
        return build_box_segment(self.center, self.size, self.parser.groups, image_size)

    def advance_token(self, token_id: int) -> None:
        """Commit a sampled token (the box's boundary token, then path tokens)."""
        self._expect(_TOKEN)
        tokens = self._rows.tokens
        if not self.in_path:
            if token_id == tokens.eos_id or (
                tokens.coord_id is not None and token_id != tokens.coord_id
            ):
                raise GrammarError(f"token {token_id} is not allowed before the box")
            self.next_kind = _COORD_X
            return
        walk = self._walk
        if token_id == tokens.eos_id:
            if not walk.automaton.accepting(walk.state):
                raise GrammarError("eos before the path may end")
            self._finish(GrammarEnd.STOP)
            return
        walk.step(token_id)
        self.path_ids.append(token_id)
        item = self._items[token_id]
        try:
            group = self.parser.push(item or "")
        except ValueError as err:  # the walk took it: the grammar and parser disagree
            raise GrammarError(str(err)) from None
        if group is not None:
            self.chunks.append((" " if self.chunks else "") + group.text())
        self._check_end()

    def advance_value(self, value: object) -> None:
        """Commit the box's center x, center y, then size (w, h)."""
        kind = self.next_kind
        if kind is _COORD_X:
            self.center = (coordinate_value(value), 0.0)
            self.next_kind = _COORD_Y
        elif kind is _COORD_Y:
            self.center = (self.center[0], coordinate_value(value))
            self.next_kind = _SIZE
        elif kind is _SIZE:
            self.size = size_value(value)
            self.in_path = True
            self.next_kind = _TOKEN
            self._check_end()
        else:
            raise GrammarError(f"expected a {kind.name} commit, got a value")

    def _check_end(self) -> None:
        if self._walk.only_eos():
            self._finish(GrammarEnd.LENGTH if self._walk.budget_bound() else GrammarEnd.STOP)
