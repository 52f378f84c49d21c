"""The mask-row registry: every mask any grammar can ask for gets one global row index.

The engine keeps ONE device tensor built from this table -- bool [n_rows, width] (51.2 KB a row
at width 51,200) or packed uint8 [n_rows, width / 8] (6.4 KB a row), see batch_masks.py -- and,
per decode step, uploads one int32 per batch row (the row index). Row 0 (NO_MASK) allows
everything, so unconstrained rows cost nothing beyond that int. Rows are deduplicated by
content: the segment path language needs about 16 rows, a typical regex tens.

The table only grows. Rows for request-time constraints (regex, choices) are appended when such
a constraint is first compiled; the engine must upload rows [uploaded, len(table)) before it
samples with a new index (`packed(start)` / `dense(start)` give exactly those rows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from .automaton import DEAD, Dfa
from .token_masks import EOS_ONLY, CompiledMasks

NO_MASK = 0


class MaskTable:
    """Append-only, deduplicated set of packed mask rows over `width` token ids."""

    def __init__(self, width: int, max_rows: int = 8192) -> None:
        if width <= 0:
            raise ValueError("width must be positive")
        self.width = width
        self.max_rows = max_rows
        self._n_bytes = (width + 7) // 8
        self._rows: list[np.ndarray] = []
        self._index: dict[bytes, int] = {}
        self._registered: dict[str, AutomatonRows] = {}
        self._lock = threading.Lock()
        self.add(np.ones(width, dtype=bool))  # NO_MASK

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, allowed: np.ndarray) -> int:
        """Row index of a bool [width] allow-mask (added if new)."""
        if allowed.shape != (self.width,):
            raise ValueError(f"mask must have shape ({self.width},)")
        return self.add_packed(np.packbits(allowed.astype(bool), bitorder="little"))

    def add_packed(self, packed: np.ndarray) -> int:
        """Row index of a packed row (numpy packbits, little bit order), added if new."""
        packed = np.ascontiguousarray(packed, dtype=np.uint8)
        if packed.shape != (self._n_bytes,):
            raise ValueError(f"packed mask must have shape ({self._n_bytes},)")
        blob = packed.tobytes()
        with self._lock:
            idx = self._index.get(blob)
            if idx is None:
                if len(self._rows) >= self.max_rows:
                    raise ValueError(f"mask table full ({self.max_rows} rows)")
                idx = len(self._rows)
                self._rows.append(packed)
                self._index[blob] = idx
            return idx

    def allow_only(self, ids: Iterable[int]) -> int:
        """Row index of a mask allowing exactly `ids`."""
        allowed = np.zeros(self.width, dtype=bool)
        allowed[list(ids)] = True
        return self.add(allowed)

    def allow_all_but(self, ids: Iterable[int]) -> int:
        """Row index of a mask allowing everything except `ids`."""
        allowed = np.ones(self.width, dtype=bool)
        allowed[list(ids)] = False
        return self.add(allowed)

    def register(self, compiled: CompiledMasks, pieces: list[bytes | None]) -> AutomatonRows:
        """Add an automaton's rows; `pieces` are the vocabulary's text pieces (for stepping)."""
        if compiled.width != self.width:
            raise ValueError(f"masks are {compiled.width} wide, the table {self.width}")
        with self._lock:
            known = self._registered.get(compiled.key)
        if known is not None:
            return known
        global_ids = [self.add_packed(row) for row in compiled.rows]
        rows = AutomatonRows(compiled, global_ids, pieces)
        with self._lock:
            return self._registered.setdefault(compiled.key, rows)

    def allowed(self, row: int) -> np.ndarray:
        """Bool [width] of one row."""
        return np.unpackbits(self._rows[row], count=self.width, bitorder="little").astype(bool)

    def packed(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """uint8 [n, ceil(width / 8)] of rows [start, stop)."""
        rows = self._rows[start:stop]
        if not rows:
            return np.zeros((0, self._n_bytes), dtype=np.uint8)
        return np.stack(rows)

    def dense(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """bool [n, width] of rows [start, stop) (what the device table holds)."""
        return np.unpackbits(
            self.packed(start, stop), axis=1, count=self.width, bitorder="little"
        ).astype(bool)


class AutomatonRows:
    """One compiled automaton seen through global row indices; O(1) lookups for the commit path.

    States and budgets follow token_masks.py: `row(state, remaining)` is the table row for the
    next token with `remaining` tokens left, or EOS_ONLY when the only way on is eos.
    """

    def __init__(
        self, compiled: CompiledMasks, global_ids: list[int], pieces: list[bytes | None]
    ) -> None:
        self.compiled = compiled
        self.dfa: Dfa = compiled.dfa
        self._pieces = pieces
        self._dist = compiled.dist.tolist()
        self._base = compiled.level_base.tolist()
        ptr = compiled.level_ptr.tolist()
        local = compiled.level_rows.tolist()
        # Per state, the global row of each level (a list lookup at commit time).
        self._levels = [
            [global_ids[r] if r != EOS_ONLY else EOS_ONLY for r in local[ptr[s] : ptr[s + 1]]]
            for s in range(len(ptr) - 1)
        ]

    def dist(self, state: int) -> int:
        """Fewest tokens from `state` to an accepting state."""
        return self._dist[state]

    def row(self, state: int, remaining: int) -> int:
        """Global row index for the next token (EOS_ONLY: only eos is left)."""
        levels = self._levels[state]
        level = min(remaining - 1, self._base[state] + len(levels) - 1) - self._base[state]
        if level < 0 or not levels:
            raise ValueError(f"state {state} cannot finish within {remaining} tokens")
        return levels[level]

    def step(self, state: int, token_id: int, remaining: int) -> int:
        """State after `token_id`, given `remaining` tokens before it; ValueError if not allowed."""
        piece = self._pieces[token_id] if 0 <= token_id < len(self._pieces) else None
        target = self.dfa.walk(state, piece) if piece else DEAD
        if target == DEAD or self._dist[target] > remaining - 1:
            raise ValueError(f"token {token_id} is not allowed here")
        return target

    def piece(self, token_id: int) -> bytes:
        """The bytes a token contributes (empty for ids without text)."""
        piece = self._pieces[token_id] if 0 <= token_id < len(self._pieces) else None
        return piece or b""

    def accepting(self, state: int) -> bool:
        """Whether eos is allowed in `state`."""
        return self.dfa.is_accepting(state)
