"""Consistent hashing with bounded loads: a key's home replica unless it is overloaded.

Each replica owns `VNODES` points on a 64-bit ring; a key walks the ring clockwise from its
own point and takes the first replica whose load stays within ``load_factor`` times the mean
(plus one request), the bound of "Consistent Hashing with Bounded Loads" (Mirrokni, Thorup,
Zadimoghaddam). With every replica at the bound, it falls back to the less loaded of two
random replicas: power of two choices. So a hot key spills to the next replica on its walk
(which then holds its prefix too) instead of queueing behind itself, and no replica's load
exceeds the bound while another has room.

The guard against power of two choices: the replica the walk found is taken only while its
load is within ``(load_factor - 1) x mean`` (at least `MIN_SLACK`) of what two choices would
have picked; otherwise two choices' pick is taken. Under light load the slack is one request,
under heavy load a fraction of the mean: a warm replica with a few more requests beats a cold
one, a warm one with many more does not. Pure: loads are given by
the caller.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from typing import TypeVar

import blake3

N = TypeVar("N")

VNODES = 64  # points per replica: spreads keys within a few percent of even for 2-16 replicas
# A warm replica holding one request more than the pick of two choices still wins: in a
# continuous batch one more row costs little, an image prefix costs a vision-tower pass. It
# also absorbs load figures that lag a request behind (a stream that just ended).
MIN_SLACK = 1


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


def load_bound(loads: Sequence[int], load_factor: float) -> int:
    """The most requests a replica may hold after taking one more."""
    total = sum(loads) + 1
    return max(1, math.ceil(load_factor * total / max(1, len(loads))))


def two_choices(names: Sequence[N], load: Callable[[N], int], rng: random.Random) -> N:
    """The less loaded of two distinct random names (the only one when there is one)."""
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(list(names), 2)
    return a if load(a) <= load(b) else b


def choose(
    ring: HashRing,
    key: str | None,
    load: Callable[[str], int],
    load_factor: float,
    rng: random.Random,
    placed: str | None = None,
) -> tuple[str, bool]:
    """The replica for ``key`` and whether it is the key's home (the first it prefers).

    ``placed``: the replica that served ``key`` last, which holds its prefix: it comes before
    the ring's walk (a key the guard once sent away stays where its prefix went). ``key``
    None (no affinity): power of two choices. Draws the two choices whatever the key, so
    that the guard compares against the pick two choices would make."""
    names = ring.names
    if not names:
        raise ValueError("no replicas")
    if key is None:
        return two_choices(names, load, rng), False
    loads = [load(n) for n in names]
    bound = load_bound(loads, load_factor)
    slack = max(MIN_SLACK, int((load_factor - 1.0) * sum(loads) / len(loads)))
    fallback = two_choices(names, load, rng)
    order = ring.walk(key)
    if placed in names:
        order = [placed, *(n for n in order if n != placed)]
    for i, name in enumerate(order):
        if load(name) + 1 <= bound:
            if load(name) <= load(fallback) + slack:
                return name, i == 0
            break
    return fallback, fallback == order[0]
