"""The segment path language: its byte DFA and its parser, defined side by side.

    path     := subpath (" " subpath)*
    subpath  := "M" pair (" " command)* " Z"
    command  := "L" pair | "Q" pair pair | "C" pair pair pair
    pair     := " " number " " number
    number   := decimal integer in 0..grid, no leading zeros

Example (grid 100): "M 10 0 L 90 0 Q 100 50 90 100 L 10 100 Z". Numbers are integer grid
units relative to the object's box: (0, 0) is its top-left corner, (grid, grid) its
bottom-right. Separators are single spaces, so the text is canonical and the grammar small.

Point budget: M and L take 1 point, Q 2, C 3. A command may start only if its points fit in
what is left of `max_points`, so once the budget is spent the only ways on are finishing the
current number and command, then " Z", then eos. Every accepted string ends with "Z".

The DFA carries the remaining point count in its state, saturated at `count_cap`: state
(s, c) for c < count_cap is exact, c == count_cap means "count_cap or more" and does not
decrease. The grammar keeps the exact count and re-enters the exact states (`with_count`)
once it drops below the cap. That is exact as long as count_cap >= 3 + the most points one
token can spend, which `PathLanguage.for_vocab` computes from the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .automaton import DEAD, Dfa

ALPHABET = b" 0123456789MLQCZ"
POINTS = {ord("M"): 1, ord("L"): 1, ord("Q"): 2, ord("C"): 3}
NUMBERS = {"M": 2, "L": 2, "Q": 4, "C": 6}
DEFAULT_GRID = 100


def _syntactic_dfa(grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(trans [S, 256], points spent [S, 256], accepting [S]) of the language without a budget."""
    if grid < 1:
        raise ValueError("grid must be at least 1")
    top = str(grid)

    def cmp(a: str, b: str) -> int:
        return (a > b) - (a < b)

    def digit_state(ndigits: int, order: int) -> tuple | None:
        # order compares the digits so far with the same-length prefix of `top`.
        if ndigits < len(top) or (ndigits == len(top) and order <= 0):
            return (ndigits, order)
        return None

    def step(state: tuple, ch: str) -> tuple | None:
        kind = state[0]
        if kind in ("start", "after_z"):
            return ("sp", 2) if ch == "M" else None
        if kind == "sp":
            return ("ns", state[1]) if ch == " " else None
        if kind == "ns":
            left = state[1] - 1
            if ch == "0":
                return ("num", left, "zero")
            if ch.isdigit():
                ds = digit_state(1, cmp(ch, top[0]))
                return ("num", left, ds) if ds else None
            return None
        if kind == "num":
            _, left, ds = state
            if ch == " ":
                return ("ns", left) if left else ("cmd",)
            if ch.isdigit() and ds != "zero":
                ndigits, order = ds
                if ndigits >= len(top):
                    return None
                new = digit_state(ndigits + 1, order if order else cmp(ch, top[ndigits]))
                return ("num", left, new) if new else None
            return None
        if kind == "cmd":
            if ch in "LQC":
                return ("sp", NUMBERS[ch])
            return ("closed",) if ch == "Z" else None
        if kind == "closed":
            return ("after_z",) if ch == " " else None
        raise AssertionError(kind)

    index: dict[tuple, int] = {("dead",): DEAD, ("start",): 1}
    order = [("dead",), ("start",)]
    edges: list[tuple[int, int, int]] = []
    pos = 1
    while pos < len(order):
        state = order[pos]
        for b in ALPHABET:
            nxt = step(state, chr(b))
            if nxt is None:
                continue
            if nxt not in index:
                index[nxt] = len(order)
                order.append(nxt)
            edges.append((pos, b, index[nxt]))
        pos += 1
    trans = np.zeros((len(order), 256), dtype=np.int32)
    spent = np.zeros((len(order), 256), dtype=np.int32)
    for s, b, t in edges:
        trans[s, b] = t
        spent[s, b] = POINTS.get(b, 0)
    accepting = np.array([s == ("closed",) for s in order], dtype=bool)
    return trans, spent, accepting


@dataclass(frozen=True, eq=False)
class PathLanguage:
    """The path DFA for one grid and point-count cap (see module docstring)."""

    grid: int
    count_cap: int

    def __post_init__(self) -> None:
        if self.count_cap < 3:
            raise ValueError("count_cap must be at least 3 (a C command spends 3 points)")

    @cached_property
    def _syntactic(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _syntactic_dfa(self.grid)

    @cached_property
    def dfa(self) -> Dfa:
        """Product of the syntactic DFA and the saturating point counter, trimmed."""
        trans, spent, accepting = self._syntactic
        n_syn, span = trans.shape[0], self.count_cap + 1
        count = np.arange(span)
        # after[s, c, b]: the count after byte b from (s, c); negative means "does not fit".
        after = count[None, :, None] - spent[:, None, :]
        after = np.where(count[None, :, None] == self.count_cap, self.count_cap, after)
        target = trans[:, None, :] * span + np.maximum(after, 0)
        target = np.where((after < 0) | (trans[:, None, :] == DEAD), DEAD, target)
        prod = target.reshape(n_syn * span, 256).astype(np.int32)
        prod[:span] = DEAD  # the syntactic DEAD row, whatever the count
        acc = np.repeat(accepting, span)
        return Dfa(prod, acc, self.state_for(1, self.count_cap)).trimmed()

    def state_for(self, syntactic: int, count: int) -> int:
        """Product state id of a syntactic state and an exact remaining point count."""
        return syntactic * (self.count_cap + 1) + min(count, self.count_cap)

    def start(self, max_points: int) -> int:
        """Start state for a path of at most `max_points` points."""
        if max_points < 1:
            raise ValueError("max_points must be at least 1")
        return self.state_for(1, max_points)

    def with_count(self, state: int, count: int) -> int:
        """`state` with its point count replaced by the exact `count` (saturated at the cap)."""
        return self.state_for(state // (self.count_cap + 1), count)

    @staticmethod
    def points_spent(data: bytes) -> int:
        """Points the command letters in `data` spend."""
        return sum(POINTS.get(b, 0) for b in data)

    @classmethod
    def for_vocab(cls, grid: int, pieces: Sequence[bytes | None]) -> PathLanguage:
        """The language with the smallest count cap that is exact for this vocabulary."""
        trans, spent, _ = _syntactic_dfa(grid)
        allowed = set(ALPHABET)
        most = 3
        rows, spends = trans.tolist(), spent.tolist()
        for piece in pieces:
            # Only tokens that spend points twice can need a larger cap than 6.
            if not piece or sum(b in POINTS for b in piece) < 2 or not set(piece) <= allowed:
                continue
            for first in range(1, len(rows)):
                state, total = first, 0
                for b in piece:
                    total += spends[state][b]
                    state = rows[state][b]
                    if state == DEAD:
                        break
                else:
                    most = max(most, total)
        return cls(grid, most + 3)


@dataclass(frozen=True)
class Command:
    """One path command: its letter and its points in grid units."""

    letter: str
    points: tuple[tuple[int, int], ...]


def parse_path(text: str, grid: int = DEFAULT_GRID) -> list[list[Command]]:
    """Parse a path of the language into subpaths (each starts with M, ends with Z).

    Raises ValueError on anything outside the language.
    """
    items = text.split(" ")
    subpaths: list[list[Command]] = []
    i = 0

    def number() -> int:
        nonlocal i
        if i >= len(items):
            raise ValueError("path ends inside a command")
        item = items[i]
        i += 1
        if not (item.isascii() and item.isdigit()) or (len(item) > 1 and item[0] == "0"):
            raise ValueError(f"bad number {item!r} in path")
        value = int(item)
        if value > grid:
            raise ValueError(f"number {value} beyond the grid {grid}")
        return value

    while True:
        if i >= len(items) or items[i] != "M":
            raise ValueError("subpath must start with 'M'")
        i += 1
        current = [Command("M", ((number(), number()),))]
        while True:
            if i >= len(items):
                raise ValueError("subpath must end with 'Z'")
            letter = items[i]
            i += 1
            if letter == "Z":
                current.append(Command("Z", ()))
                break
            if letter not in ("L", "Q", "C"):
                raise ValueError(f"unknown command {letter!r} in path")
            n_points = NUMBERS[letter] // 2
            current.append(Command(letter, tuple((number(), number()) for _ in range(n_points))))
        subpaths.append(current)
        if i == len(items):
            return subpaths
