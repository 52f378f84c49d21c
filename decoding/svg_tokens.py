"""Moondream 3's segment path: SVG text written one token per item, in a 960-unit box.

The model spells its path with ordinary text tokens, and each token is read on its own: ids up
to 20 are dropped, every other id is decoded alone (special tokens skipped) and stripped of
whitespace, and empty results are dropped. What is left is a list of items:

    item     := letter | "-" | integer
    letter   := M m L l H h V v C c S s Q q T t A a Z z     (any SVG command)
    integer  := ASCII digits, at most NUMBER_BOUND          ("-" before one negates it)

A token that is whitespace alone (its item is empty) may separate two items, never follow another
one. Items form a path by SVG's rules: it starts with a moveto (M or m); each command takes its
arguments in groups of its arity (two for M L T, one for H V, four for S Q, six for C, seven for
A, none for Z), one group or more, so further groups repeat the command (after M they are
lines, as in SVG). An arc's rotation is an angle in degrees and its two flags are "0" or "1";
every other argument is a coordinate in a box of GRID units spanning the object's box.

Scaled, coordinates are divided by GRID (box-relative: 0 at the box's left or top edge, 1 at
its right or bottom edge) and printed with at most three decimals, trailing zeros stripped; the
path is every item joined with single spaces: ``M 480 0 L - 10 960`` becomes
``M 0.5 0 L -0.01 1``. The arc's angle and flags are printed as written (the model author's
engine divides those by GRID too, which leaves no valid SVG: flags must be 0 or 1).

NUMBER_BOUND is 2 x GRID: an absolute coordinate may lie up to one box beyond each edge (curve
control points overshoot; a coarse box may cut the object), and a relative step may cross the
box and as much again. One parser (`PathParser`) decides what is a path; the token grammar
(svg_token_dfa.py) is generated from its transitions, so both accept exactly the same items.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

GRID = 960
NUMBER_BOUND = 2 * GRID
# Ids up to this one are dropped from the path (the model author's engine: specials live there).
LAST_DROPPED_ID = 20

ARITY = {
    **dict.fromkeys("MmLlTt", 2),
    **dict.fromkeys("HhVv", 1),
    **dict.fromkeys("SsQq", 4),
    **dict.fromkeys("Cc", 6),
    **dict.fromkeys("Aa", 7),
    **dict.fromkeys("Zz", 0),
}
LETTERS = "".join(ARITY)
# What each argument of an arc is: coordinate (scaled), degrees and flags (kept as written).
ARC_ROLES = "ccdffcc"
COORD, DEGREES, FLAG = "c", "d", "f"

# Item kinds, one byte each: the token grammar's alphabet. A letter is its own kind.
MINUS, FLAG_NUMBER, NUMBER, SPACE = "-", "0", "#", " "


def role(letter: str, index: int) -> str:
    """What argument ``index`` of ``letter`` is: COORD, DEGREES or FLAG."""
    return ARC_ROLES[index] if letter in "Aa" else COORD


def item_kind(item: str) -> str | None:
    """The kind of one stripped item: a letter, MINUS, FLAG_NUMBER ("0" or "1", which may also
    stand for an arc's flag), NUMBER, SPACE (an empty item: a whitespace token), or None
    (nothing a path may hold)."""
    if not item:
        return SPACE
    if item in ARITY or item == MINUS:
        return item
    if item in ("0", "1"):
        return FLAG_NUMBER
    if item.isascii() and item.isdigit() and int(item) <= NUMBER_BOUND:
        return NUMBER
    return None


@dataclass(frozen=True)
class State:
    """Where a path stands: the command being written (None before the first), the arguments
    of its current group so far, whether a "-" waits for its number, whether the command has
    a complete group (so a new command or the end may come), and whether the last token was
    whitespace."""

    letter: str | None = None
    args: int = 0
    minus: bool = False
    complete: bool = False
    spaced: bool = False

    @property
    def accepting(self) -> bool:
        """Whether the path may end here."""
        return self.letter is not None and self.complete and not self.args and not self.minus


START = State()


def next_state(state: State, kind: str) -> State | None:
    """The state after an item of ``kind`` (None: the item cannot come here)."""
    if kind == SPACE:
        # A whitespace token adds nothing, so one may separate items (a tokenizer may split
        # a space off), but never two in a row: a path of nothing but whitespace could
        # otherwise run to the budget.
        return None if state.spaced else dataclasses.replace(state, spaced=True)
    letter = state.letter
    if kind in ARITY:
        if letter is None:
            return State(kind) if kind in "Mm" else None
        if not state.accepting:
            return None
        return State(kind, complete=ARITY[kind] == 0)
    if letter is None or ARITY[letter] == 0:
        return None
    flag = role(letter, state.args) == FLAG
    if kind == MINUS:
        return None if state.minus or flag else State(letter, state.args, True, state.complete)
    if flag and kind != FLAG_NUMBER:
        return None
    args = state.args + 1
    if args == ARITY[letter]:
        return State(letter, 0, False, True)
    return State(letter, args, False, state.complete)


@dataclass(frozen=True)
class PathGroup:
    """One group of a command's arguments as written: its letter, whether it repeats the
    previous group's command implicitly (no letter written), and its integer arguments."""

    letter: str
    repeat: bool
    args: tuple[int, ...]

    @property
    def command(self) -> str:
        """The command the group draws: a repeated moveto draws lines, as in SVG."""
        if self.repeat and self.letter in "Mm":
            return "L" if self.letter == "M" else "l"
        return self.letter

    def values(self) -> tuple[float, ...]:
        """The arguments scaled: coordinates over GRID (box-relative), angle and flags kept."""
        letter = self.letter
        return tuple(
            v / GRID if role(letter, i) == COORD else float(v) for i, v in enumerate(self.args)
        )

    def text(self) -> str:
        """The group as path text: its letter (unless it repeats) and its scaled arguments."""
        letter = self.letter
        parts = [] if self.repeat else [letter]
        for i, v in enumerate(self.args):
            parts.append(format_number(v / GRID) if role(letter, i) == COORD else str(v))
        return " ".join(parts)


def format_number(value: float) -> str:
    """At most three decimals, trailing zeros (and a bare point) stripped."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


class PathParser:
    """Reads a path item by item (`push`), so a stream can send each group as it completes."""

    def __init__(self) -> None:
        self.state = START
        self.groups: list[PathGroup] = []
        self._args: list[int] = []
        self._repeat = False

    def push(self, item: str) -> PathGroup | None:
        """Take one stripped item; returns the group it completes, if any. ValueError if the
        item cannot continue the path."""
        kind = item_kind(item)
        nxt = next_state(self.state, kind) if kind is not None else None
        if kind is None or nxt is None:
            where = "at the start" if self.state.letter is None else f"in {self.state.letter}"
            raise ValueError(f"item {item!r} cannot come {where}")
        before, self.state = self.state, nxt
        if kind in (SPACE, MINUS):
            return None
        if kind in ARITY:
            self._args, self._repeat = [], False
            if ARITY[kind]:
                return None
            return self._close(kind)
        value = int(item)
        self._args.append(-value if before.minus else value)
        if nxt.args == 0:  # the group is complete
            return self._close(nxt.letter)  # type: ignore[arg-type]
        return None

    def _close(self, letter: str) -> PathGroup:
        group = PathGroup(letter, self._repeat, tuple(self._args))
        self.groups.append(group)
        self._args, self._repeat = [], True
        return group

    def finish(self) -> list[PathGroup]:
        """The groups of the whole path; ValueError if it cannot end here."""
        if not self.state.accepting:
            raise ValueError("the path is empty or ends inside a command")
        return self.groups


def parse_items(items: Iterable[str]) -> list[PathGroup]:
    """The groups of a complete path of stripped items (empty items are skipped)."""
    parser = PathParser()
    for item in items:
        parser.push(item)
    return parser.finish()


def chunk_texts(groups: Sequence[PathGroup]) -> list[str]:
    """The path as the stream sends it: one chunk per group, each after the first starting with
    the space that joins it, so the chunks concatenate to `path_text`."""
    return [(" " if i else "") + g.text() for i, g in enumerate(groups)]


def path_text(groups: Sequence[PathGroup]) -> str:
    """The scaled path (box-relative)."""
    return " ".join(g.text() for g in groups)


def decode_items(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """The items of a path's token ids, as the model author's engine reads them: ids above
    LAST_DROPPED_ID, each decoded on its own without special tokens, stripped, empties dropped."""
    kept = [[t] for t in token_ids if t > LAST_DROPPED_ID]
    texts = tokenizer.decode_batch(kept, skip_special_tokens=True) if kept else []
    return [s for s in (t.strip() for t in texts) if s]


def token_items(tokenizer: Tokenizer, special_ids: Iterable[int]) -> list[str | None]:
    """Per token id: its stripped text when decoded alone (what it adds to a path), or None for
    ids a path never holds (dropped ids, special and unknown ones)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    special = set(special_ids)
    known = set(tokenizer.get_vocab(with_added_tokens=True).values())
    return [
        text.strip() if i > LAST_DROPPED_ID and i not in special and i in known else None
        for i, text in enumerate(texts)
    ]
