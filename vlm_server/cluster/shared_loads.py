"""The gateway workers' loads, shared: each worker's work in flight per replica, in memory
every worker maps, so each routes by what all of them have sent (not its share alone).

Why: a worker sees only the requests of its own connections. With many workers that share
is small and noisy: a hot picture would not spread until its holder's queue, seen from one
worker, passed a miss cost, and new pictures would all go to the replica that every worker's
empty view calls idle (bench/routing_sim.py: at 16 workers, one picture nine requests in
ten, p99 latency behind power of two choices; with shared loads ahead at every count).

Layout: one row per worker, one column per replica slot; a worker writes only its own row (no
lock: each cell has one writer, and an aligned 8-byte store is never seen half done), readers
sum the columns. The parent gives each replica a slot (`SlotTable`) with the members it feeds
the workers, so every worker reads the same column for it.
"""

from __future__ import annotations

from multiprocessing.sharedctypes import RawArray
from typing import Any

import numpy as np

MAX_SLOTS = 1024  # replicas one gateway routes to at once; beyond, a replica has no column


class SharedLoads:
    """``workers`` rows of `MAX_SLOTS` work figures in shared memory. Made by the parent and
    handed to each worker process when it is spawned (as a `Process` argument)."""

    def __init__(self, workers: int, slots: int = MAX_SLOTS) -> None:
        if workers < 1 or slots < 1:
            raise ValueError("SharedLoads needs at least one worker and one slot")
        self.workers = workers
        self.slots = slots
        self._raw: Any = RawArray("d", workers * slots)
        self._view: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:  # the array travels; the numpy view is remade
        return {"workers": self.workers, "slots": self.slots, "_raw": self._raw, "_view": None}

    def grid(self) -> np.ndarray:
        """Workers x slots, over the shared memory itself."""
        if self._view is None:
            flat = np.frombuffer(self._raw, dtype=np.float64)
            self._view = flat.reshape(self.workers, self.slots)
        return self._view

    def row(self, worker: int) -> WorkerLoads:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not one of {self.workers}")
        return WorkerLoads(self, worker)

    def clear(self, worker: int) -> None:
        """Zero a worker's row (it exited: its requests are no one's work now)."""
        self.grid()[worker] = 0.0


class WorkerLoads:
    """One worker's side: it writes its own row and reads every row's sum."""

    def __init__(self, shared: SharedLoads, worker: int) -> None:
        self._grid = shared.grid()
        self._mine = self._grid[worker]
        self.slots = shared.slots

    def set(self, slot: int, work: float) -> None:
        """This worker's work in flight at ``slot`` is now ``work``."""
        self._mine[slot] = work

    def totals(self, used: int) -> np.ndarray:
        """Every worker's work summed, for slots below ``used``."""
        return self._grid[:, :used].sum(axis=0)


class SlotTable:
    """The parent's replica -> slot assignment: a replica keeps its slot while it is a
    member; a freed slot goes to the next new replica, lowest first (so the columns to sum
    stay few)."""

    def __init__(self, slots: int = MAX_SLOTS) -> None:
        self._slots = slots
        self._of: dict[str, int] = {}

    def assign(self, names: list[str]) -> dict[str, int | None]:
        """Slots of ``names`` (the current members); None for a replica past `MAX_SLOTS`."""
        for name in [n for n in self._of if n not in names]:
            del self._of[name]
        taken = set(self._of.values())
        free = (s for s in range(self._slots) if s not in taken)
        for name in names:
            if name not in self._of:
                slot = next(free, None)
                if slot is not None:
                    self._of[name] = slot
        return {name: self._of.get(name) for name in names}
