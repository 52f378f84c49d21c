"""Which adapter each device slot holds, and which slot to (re)use (CUDA-free).

A slot holds one adapter. It is pinned while requests use it (from admission until no step
in flight reads their rows); an unpinned slot stays resident, least recently used first to
be reused. A slot being filled is pinned by the load until it completes.
"""

from __future__ import annotations

from collections import OrderedDict


class AdapterSlots:
    """Slot bookkeeping; not thread-safe (its owner holds a lock)."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.pins = [0] * n_slots
        self.names: list[str | None] = [None] * n_slots
        # Resident adapters, least recently used first.
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    def resident(self) -> list[tuple[str, int]]:
        """(name, slot) of every loaded adapter, least recently used first."""
        return list(self._lru.items())

    def pin(self, name: str) -> int | None:
        """Pin ``name``'s slot if it is resident; None otherwise."""
        slot = self._lru.get(name)
        if slot is not None:
            self.pins[slot] += 1
            self._lru.move_to_end(name)
        return slot

    def claim(self) -> int | None:
        """A slot to load into, pinned: an empty one, else the least recently used unpinned
        one (its adapter is forgotten); None when every slot is pinned."""
        slot = next((i for i, n in enumerate(self.names) if n is None and not self.pins[i]), None)
        if slot is None:
            for name, s in self._lru.items():
                if not self.pins[s]:
                    del self._lru[name]
                    self.evictions += 1
                    slot = s
                    break
        if slot is None:
            return None
        self.names[slot] = None
        self.pins[slot] = 1
        return slot

    def filled(self, slot: int, name: str) -> None:
        """The load into ``slot`` completed: ``name`` is resident (still pinned once)."""
        self.names[slot] = name
        self._lru[name] = slot
        self.loads += 1

    def abandon(self, slot: int) -> None:
        """A load into ``slot`` failed: the slot is empty and free."""
        self.names[slot] = None
        self.pins[slot] = 0

    def unpin(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise AssertionError(f"adapter slot {slot} unpinned more often than pinned")
        self.pins[slot] -= 1
