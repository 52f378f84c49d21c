"""Image affinity with a load guard: consistent hashing for new pictures, and the replicas
that hold a picture's prefix for repeats.

Each replica owns `VNODES` points on a 64-bit ring; a key walks the ring clockwise from its
own point. The guard weighs what moving a request costs:

- A key no replica holds yet (its first request): its prefix must be computed wherever it
  goes, so moving it costs nothing. It goes to its ring home while the home's load is no more
  than what power of two choices would pick, else to the next replica on its walk that is,
  else to two choices' pick: new pictures keep the replicas balanced.
- A key some replicas hold (they computed its prefix): moving it costs a vision-tower pass.
  The least loaded holder keeps it unless its load is above the least loaded replica's by
  more than that cost and more than ``(load_factor - 1) x mean``; then that replica
  takes it and becomes a holder too, so a hot picture spreads over as many replicas as its
  traffic needs and its holders share it, as power of two choices would.

Pure: loads are given by the caller; `AffinityMemory` remembers the holders.
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import blake3

N = TypeVar("N")

VNODES = 64  # points per replica: spreads keys within a few percent of even for 2-16 replicas
# A new picture goes home only while home has no more work than two choices' pick: its
# prefix costs the same anywhere, so balance decides, and ties keep the ring's order.
MIN_SLACK = 0
# Keys whose holders are remembered: far more pictures than any replica's prefix cache.
MAX_REMEMBERED = 1 << 17


def _point(text: str) -> int:
    return int.from_bytes(blake3.blake3(text.encode()).digest(length=8), "big")


class HashRing:
    """The ring of a set of replica names; rebuilt when the set changes."""

    def __init__(self, names: Sequence[str], vnodes: int = VNODES) -> None:
        points = sorted((_point(f"{name}#{i}"), name) for name in names for i in range(vnodes))
        self.names = tuple(sorted(set(names)))
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: str) -> list[str]:
        """Every replica once, in the order ``key`` prefers them."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, _point(key))
        seen: list[str] = []
        n = len(self._owners)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.names):
                    break
        return seen


def two_choices(names: Sequence[N], load: Callable[[N], float], rng: random.Random) -> N:
    """The less loaded of two distinct random names (the only one when there is one)."""
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(list(names), 2)
    return a if load(a) <= load(b) else b


def choose(
    ring: HashRing,
    key: str | None,
    load: Callable[[str], float],
    load_factor: float,
    rng: random.Random,
    holders: Sequence[str] = (),
    miss_cost: float = 1.0,
) -> tuple[str, bool]:
    """The replica for ``key`` and whether it is where the key belongs (a holder of its
    prefix, or for a new key its ring home). ``holders``: replicas that hold the key's prefix,
    most recent first (see the module's doc). ``miss_cost``: what computing a prefix costs in
    the loads' units; a repeat never moves for less. ``key`` None (no affinity): power of two
    choices."""
    names = ring.names
    if not names:
        raise ValueError("no replicas")
    if key is None:
        return two_choices(names, load, rng), False
    held = [n for n in holders if n in names]
    if held:
        keeper = min(held, key=load)  # ties: the most recent holder
        least = min(names, key=load)
        mean = sum(load(n) for n in names) / len(names)
        slack = max(MIN_SLACK, miss_cost, (load_factor - 1.0) * mean)
        if load(keeper) <= load(least) + slack:
            return keeper, True
        return least, False
    fallback = two_choices(names, load, rng)
    order = ring.walk(key)
    for i, name in enumerate(order):
        if load(name) <= load(fallback) + MIN_SLACK:
            return name, i == 0
    return fallback, fallback == order[0]


class AffinityMemory:
    """Which replicas hold each key's prefix (those it was sent to), most recent first; the
    least recently used keys are forgotten beyond ``capacity``."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self._capacity = capacity
        self._holders: OrderedDict[str, list[str]] = OrderedDict()

    def holders(self, key: str | None) -> list[str]:
        return list(self._holders.get(key, ())) if key is not None else []

    def sent(self, key: str | None, name: str) -> None:
        """``key``'s request went to ``name``, which now holds (or computes) its prefix."""
        if key is None:
            return
        held = [name, *(n for n in self._holders.get(key, ()) if n != name)]
        self._holders[key] = held
        self._holders.move_to_end(key)
        if len(self._holders) > self._capacity:
            self._holders.popitem(last=False)
