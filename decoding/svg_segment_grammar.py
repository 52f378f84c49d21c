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
    GrammarEnd,
    GrammarError,
)
from .mask_table import AutomatonRows
from .region_grammars import BoxThenPathGrammar, RegionRows
from .segment_output import SegmentResult
from .svg_geometry import Box, build_box_segment, clamped_box
from .svg_tokens import PathParser


@dataclass(frozen=True)
class SvgTokenRows:
    """The path grammar registered in a mask table, and each token id's item (its stripped
    text alone; None for ids a path never holds)."""

    automaton: AutomatonRows
    items: tuple[str | None, ...]


class SvgTokenSegmentGrammar(BoxThenPathGrammar):
    """Segment in Moondream 3's language: box, then path tokens, then eos."""

    def __init__(self, rows: RegionRows, path: SvgTokenRows, max_tokens: int) -> None:
        walk = BudgetedWalk(path.automaton, path.automaton.dfa.start, max_tokens)
        super().__init__(rows, walk, max_tokens)
        self._items = path.items
        self.path_ids: list[int] = []  # the path's tokens, as committed
        self.parser = PathParser()
        self.chunks: list[str] = []

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

    def _path_token(self, token_id: int) -> None:
        self.path_ids.append(token_id)
        item = self._items[token_id]
        try:
            group = self.parser.push(item or "")
        except ValueError as err:  # the walk took it: the grammar and parser disagree
            raise GrammarError(str(err)) from None
        if group is not None:
            self.chunks.append((" " if self.chunks else "") + group.text())

    def _check_end(self) -> None:
        if self._walk.only_eos():
            self._finish(GrammarEnd.LENGTH if self._walk.budget_bound() else GrammarEnd.STOP)
