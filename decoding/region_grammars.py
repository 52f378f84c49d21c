"""Region grammars: point and detect (object loops) and segment (one box, then a path).

Region steps are not tokens: after a boundary token the engine decodes x (from the same hidden
state), then y, then for detect/segment a size, each from the region heads, and feeds their
embeddings as the next inputs (see grammars.py for the protocol).
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
from .mask_table import NO_MASK, AutomatonRows, MaskTable
from .segment_output import SegmentResult, build_segment
from .svg_path import PathLanguage

# Module constants: see grammar_base.py.
_TOKEN, _COORD_X = StepKind.TOKEN, StepKind.COORD_X
_COORD_Y, _SIZE = StepKind.COORD_Y, StepKind.SIZE


@dataclass(frozen=True)
class RegionTokens:
    """Token contract of the region tasks.

    At the first point/detect object boundary the token is chosen over the whole vocabulary,
    as both families' reference code does: eos ends the answer, anything else starts an object
    (the token is never fed back, so the answer parses whatever it is). At later boundaries
    the same holds unless `later_coord_or_eos` (Moondream 3): then only `coord_id` and eos
    compete. `coord_id` (2025-06 contract; None in the GPT-2 era) is also the only token
    segment's box may start with.
    """

    eos_id: int
    coord_id: int | None = None
    later_coord_or_eos: bool = False

    def __post_init__(self) -> None:
        if self.later_coord_or_eos and self.coord_id is None:
            raise ValueError("later_coord_or_eos needs a coord_id")


@dataclass(frozen=True)
class RegionRows:
    """The fixed rows of point/detect/segment, registered once per table (pinned).

    `later_boundary` is the row of a point/detect boundary after the first object: NO_MASK
    (the whole vocabulary) or the row allowing only coord and eos."""

    tokens: RegionTokens
    segment_start: int
    later_boundary: int = NO_MASK

    @classmethod
    def register(cls, table: MaskTable, tokens: RegionTokens) -> RegionRows:
        """Register the rows for `tokens` in `table` (pinned)."""
        if tokens.coord_id is None:
            return cls(tokens, table.allow_all_but([tokens.eos_id]))
        later = NO_MASK
        if tokens.later_coord_or_eos:
            later = table.allow_only([tokens.coord_id, tokens.eos_id])
        return cls(tokens, table.allow_only([tokens.coord_id]), later)


class ObjectGrammar(GrammarBase):
    """Point (x, y) or detect (x, y, size) loop: boundary token, then region values, repeat."""

    def __init__(self, rows: RegionRows, max_objects: int, with_size: bool) -> None:
        super().__init__()
        if max_objects < 0:
            raise ValueError("max_objects must be >= 0")
        self._rows = rows
        self._max_objects = max_objects
        self._with_size = with_size
        self._x = self._y = 0.0
        self.objects: list[tuple[float, ...]] = []
        # The next step's mask row, kept current by every commit: the scheduler reads it per
        # row per step, so it is one attribute read.
        self._row = NO_MASK
        self._boundary()

    @property
    def mask_row(self) -> int:
        """Mask row of the next step: NO_MASK at the first boundary (the whole vocabulary)
        and for values; the contract's later-boundary row after an object."""
        return self._row

    @property
    def feeds_token(self) -> bool:
        """Boundary tokens are never fed back."""
        return False

    @property
    def max_positions(self) -> int:
        """Upper bound on positions this request feeds after its prompt."""
        return self._max_objects * (3 if self._with_size else 2)

    def advance_token(self, token_id: int) -> None:
        """Commit the boundary token: eos ends the answer, anything else starts an object."""
        self._expect(_TOKEN)
        self._row = NO_MASK
        if token_id == self._rows.tokens.eos_id:
            self._finish(GrammarEnd.STOP)
        else:
            self.next_kind = _COORD_X

    def advance_value(self, value: object) -> None:
        """Commit a decoded coordinate (float) or size ((w, h))."""
        kind = self.next_kind
        if kind is _COORD_X:
            self._x = coordinate_value(value)
            self.next_kind = _COORD_Y
        elif kind is _COORD_Y:
            self._y = coordinate_value(value)
            if self._with_size:
                self.next_kind = _SIZE
            else:
                self.objects.append((self._x, self._y))
                self._boundary()
        elif kind is _SIZE:
            w, h = size_value(value)
            x, y = self._x, self._y
            self.objects.append((x - w / 2, y - h / 2, x + w / 2, y + h / 2))
            self._boundary()
        else:
            raise GrammarError(f"expected a {kind.name} commit, got a value")

    def _boundary(self) -> None:
        if len(self.objects) >= self._max_objects:
            self._finish(GrammarEnd.LENGTH)
        else:
            self.next_kind = _TOKEN
            if self.objects:
                self._row = self._rows.later_boundary


def point_grammar(rows: RegionRows, max_objects: int = 50) -> ObjectGrammar:
    """Grammar of a point request; `objects` holds (x, y) pairs."""
    return ObjectGrammar(rows, max_objects, with_size=False)


def detect_grammar(rows: RegionRows, max_objects: int = 50) -> ObjectGrammar:
    """Grammar of a detect request; `objects` holds (x_min, y_min, x_max, y_max) boxes."""
    return ObjectGrammar(rows, max_objects, with_size=True)


@dataclass(frozen=True)
class PathRows:
    """The segment path language registered in a mask table."""

    language: PathLanguage
    automaton: AutomatonRows


class BoxThenPathGrammar(GrammarBase):
    """What every segment language shares: a box (boundary token, x, y, size; eos not
    allowed before it), then path tokens under a budgeted walk, then eos. Subclasses commit
    path tokens (`_path_token`) and say when the walk has ended (`_check_end`)."""

    def __init__(self, rows: RegionRows, walk: BudgetedWalk, max_tokens: int) -> None:
        super().__init__()
        self._rows = rows
        self._walk = walk
        self._max_tokens = max_tokens
        self.in_path = False
        self.center = (0.0, 0.0)
        self.size = (0.0, 0.0)

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
                raise GrammarError("eos before the path is closed")
            self._finish(GrammarEnd.STOP)
            return
        walk.step(token_id)
        self._path_token(token_id)
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

    def _path_token(self, token_id: int) -> None:
        raise NotImplementedError

    def _check_end(self) -> None:
        raise NotImplementedError


class SegmentGrammar(BoxThenPathGrammar):
    """Segment: one box, then an SVG path in text tokens (see svg_path.py) closed validly
    within `max_tokens` and `max_points`, then eos."""

    def __init__(
        self, rows: RegionRows, path: PathRows, max_points: int = 64, max_tokens: int = 512
    ) -> None:
        walk = BudgetedWalk(path.automaton, path.language.start(max_points), max_tokens)
        super().__init__(rows, walk, max_tokens)
        self._path = path
        self._points = max_points
        self.path_bytes = bytearray()

    @property
    def path_text(self) -> str:
        """The path committed so far (always valid UTF-8: the language is ASCII)."""
        return self.path_bytes.decode("ascii")

    def result(self, image_size: tuple[int, int]) -> SegmentResult:
        """The finished answer: box, normalized path, polygons and RLE mask for an image of
        (width, height) pixels."""
        if not self.finished:
            raise GrammarError("segment result asked for before the grammar finished")
        grid = self._path.language.grid
        return build_segment(self.center, self.size, self.path_text, image_size, grid)

    def _path_token(self, token_id: int) -> None:
        walk = self._walk
        piece = walk.automaton.piece(token_id)
        self.path_bytes += piece
        language = self._path.language
        self._points -= language.points_spent(piece)
        walk.state = language.with_count(walk.state, self._points)

    def _check_end(self) -> None:
        if self._walk.only_eos():
            bound = self._walk.budget_bound() or self._points <= 0
            self._finish(GrammarEnd.LENGTH if bound else GrammarEnd.STOP)
