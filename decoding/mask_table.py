"""The mask-row registry: every mask any grammar can ask for gets one global row index.

The engine keeps ONE device tensor built from this table -- bool [n_rows, width] (51.2 KB a row
at width 51,200) or packed uint8 [n_rows, width / 8] (6.4 KB a row), see batch_masks.py -- and,
per decode step, uploads one int32 per batch row (the row index). Row 0 (NO_MASK) allows
everything, so unconstrained rows cost nothing beyond that int. Rows are deduplicated by
content: the segment path language needs about 16 rows, a typical regex tens.

Row lifecycle:
  * pinned rows (NO_MASK, suppression, region and segment-path rows) live forever;
  * request rows (regex, choices) are reference-counted: `register` takes one reference per
    row for the request, `release` gives it back. A row nobody references is IDLE: its content
    stays valid (a repeated constraint revives it without an upload) until the slot is needed
    for new content, oldest idle first. `MaskTableFull` only when every row is live.

Device copy: a reclaimed slot is rewritten on the host and marked dirty; the engine uploads
dirty rows (`take_dirty`) before it samples with any index it holds. Rewriting is safe because
a row's last reference is released only when no in-flight step can still read it (the engine
releases a request's rows when its in-flight references reach zero).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from .automaton import DEAD, Dfa
from .token_masks import EOS_ONLY, CompiledMasks

NO_MASK = 0


class MaskTableFull(RuntimeError):
    """Every row of the table is referenced by a live request or pinned."""


class MaskTable:
    """Deduplicated, reference-counted set of packed mask rows over `width` token ids."""

    def __init__(self, width: int, max_rows: int = 8192) -> None:
        if width <= 0:
            raise ValueError("width must be positive")
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.width = width
        self.max_rows = max_rows
        self._n_bytes = (width + 7) // 8
        self._data = np.zeros((max_rows, self._n_bytes), dtype=np.uint8)
        self._used = 0  # high-water mark: slots [0, _used) have been written at least once
        self._index: dict[bytes, int] = {}  # content -> slot, for every valid slot
        self._refs = np.zeros(max_rows, dtype=np.int64)
        self._pinned = np.zeros(max_rows, dtype=bool)
        self._idle: OrderedDict[int, None] = OrderedDict()  # valid, unreferenced; oldest first
        self._dirty: set[int] = set()
        self._registered: dict[str, AutomatonRows] = {}
        self._users: dict[str, int] = {}
        self._lock = threading.Lock()
        self.add(np.ones(width, dtype=bool))  # NO_MASK

    def __len__(self) -> int:
        """Slots ever written (row indices are below this)."""
        return self._used

    @property
    def live_rows(self) -> int:
        """Rows pinned or referenced by a live request."""
        with self._lock:
            return int((self._pinned[: self._used] | (self._refs[: self._used] > 0)).sum())

    # ---- pinned rows (built-in tasks) ---------------------------------------------------

    def add(self, allowed: np.ndarray) -> int:
        """Pinned row index of a bool [width] allow-mask (added if new)."""
        if allowed.shape != (self.width,):
            raise ValueError(f"mask must have shape ({self.width},)")
        return self.add_packed(np.packbits(allowed.astype(bool), bitorder="little"))

    def add_packed(self, packed: np.ndarray) -> int:
        """Pinned row index of a packed row (numpy packbits, little bit order), added if new."""
        blob = self._blob(packed)
        with self._lock:
            slot = self._acquire_locked(blob)
            self._pinned[slot] = True
            self._refs[slot] -= 1  # a pin is not a reference
            return slot

    def allow_only(self, ids: Iterable[int]) -> int:
        """Pinned row index of a mask allowing exactly `ids`."""
        allowed = np.zeros(self.width, dtype=bool)
        allowed[list(ids)] = True
        return self.add(allowed)

    def allow_all_but(self, ids: Iterable[int]) -> int:
        """Pinned row index of a mask allowing everything except `ids`."""
        allowed = np.ones(self.width, dtype=bool)
        allowed[list(ids)] = False
        return self.add(allowed)

    def pin(self, rows: AutomatonRows) -> None:
        """Keep a registered automaton's rows forever (built-in languages)."""
        with self._lock:
            self._pinned[rows.global_ids] = True

    # ---- reference-counted rows (request constraints) -------------------------------------

    def register(self, compiled: CompiledMasks, pieces: list[bytes | None]) -> AutomatonRows:
        """Take a reference on an automaton's rows; `release` it when the request is done.

        `pieces` are the vocabulary's text pieces (for stepping). Raises MaskTableFull (and
        takes nothing) when the rows do not fit beside the live ones.
        """
        if compiled.width != self.width:
            raise ValueError(f"masks are {compiled.width} wide, the table {self.width}")
        blobs = [self._blob(row) for row in compiled.rows]
        with self._lock:
            known = self._registered.get(compiled.key)
            if known is not None:
                self._users[compiled.key] += 1
                return known
            taken: list[int] = []
            try:
                for blob in blobs:
                    taken.append(self._acquire_locked(blob))
            except MaskTableFull:
                for slot in taken:
                    self._unref_locked(slot)
                raise
            rows = AutomatonRows(compiled, taken, pieces)
            self._registered[compiled.key] = rows
            self._users[compiled.key] = 1
            return rows

    def release(self, rows: AutomatonRows) -> None:
        """Give back one `register` reference; rows nobody uses become reclaimable."""
        key = rows.compiled.key
        with self._lock:
            if self._registered.get(key) is not rows:
                raise ValueError("release of rows that are not registered")
            self._users[key] -= 1
            if self._users[key] == 0:
                del self._users[key], self._registered[key]
                for slot in rows.global_ids:
                    self._unref_locked(slot)

    def refs(self, row: int) -> int:
        """Live references to `row` (pins not counted)."""
        with self._lock:
            return int(self._refs[row])

    # ---- reading ------------------------------------------------------------------------

    def allowed(self, row: int) -> np.ndarray:
        """Bool [width] of one row."""
        return np.unpackbits(self._data[row], count=self.width, bitorder="little").astype(bool)

    def packed(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """uint8 [n, ceil(width / 8)] of rows [start, stop) (stop at most `len(self)`)."""
        with self._lock:
            stop = self._used if stop is None else min(stop, self._used)
            return self._data[start:stop].copy()

    def dense(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """bool [n, width] of rows [start, stop) (what the device table holds)."""
        return np.unpackbits(
            self.packed(start, stop), axis=1, count=self.width, bitorder="little"
        ).astype(bool)

    def take_dirty(self) -> tuple[np.ndarray, np.ndarray]:
        """(row ids ascending, packed rows) written since the last call: what to upload.

        The snapshot is taken under the lock, so a row rewritten after this call is dirty
        again and goes up with the next one.
        """
        with self._lock:
            ids = np.array(sorted(self._dirty), dtype=np.int64)
            self._dirty.clear()
            return ids, self._data[ids].copy()

    def take_dirty_runs(self) -> list[tuple[int, np.ndarray]]:
        """`take_dirty` as (first row id, bool [n, width]) runs of consecutive rows: one
        host-to-device copy each."""
        # Most steps have nothing new: skip the lock and the copies. Reading the set without
        # the lock is safe: a row a request needs was written before the request reached
        # the caller's thread, and one added right after this check goes up with the next call.
        if not self._dirty:
            return []
        ids, packed = self.take_dirty()
        if not ids.size:
            return []
        dense = np.unpackbits(packed, axis=1, count=self.width, bitorder="little").astype(bool)
        breaks = (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()
        bounds = list(zip([0, *breaks], [*breaks, ids.size], strict=True))
        return [(int(ids[lo]), dense[lo:hi]) for lo, hi in bounds]

    # ---- internals (lock held) -------------------------------------------------------------

    def _blob(self, packed: np.ndarray) -> bytes:
        packed = np.ascontiguousarray(packed, dtype=np.uint8)
        if packed.shape != (self._n_bytes,):
            raise ValueError(f"packed mask must have shape ({self._n_bytes},)")
        return packed.tobytes()

    def _acquire_locked(self, blob: bytes) -> int:
        slot = self._index.get(blob)
        if slot is None:
            slot = self._free_slot_locked()
            self._data[slot] = np.frombuffer(blob, dtype=np.uint8)
            self._index[blob] = slot
            self._dirty.add(slot)
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        return slot

    def _free_slot_locked(self) -> int:
        if self._used < self.max_rows:
            self._used += 1
            return self._used - 1
        if not self._idle:
            raise MaskTableFull(f"mask table full ({self.max_rows} rows in use)")
        slot, _ = self._idle.popitem(last=False)  # the least recently used idle row
        del self._index[self._data[slot].tobytes()]
        return slot

    def _unref_locked(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] < 0:
            raise AssertionError(f"mask row {slot} released more often than taken")
        if self._refs[slot] == 0 and not self._pinned[slot]:
            self._idle[slot] = None


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
        self.global_ids = list(global_ids)
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
