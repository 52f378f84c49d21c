"""GPU cards by name, for planning without one: memory and compute capability.

A minimal list, kept here in one place until it joins the project's chip table (which will
hold these same facts with the rest of what each chip can do). Memory is the card's total as
the driver reports it, in bytes: a "24 GB" card reports about 23.6 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Card:
    name: str
    memory_bytes: int
    capability: tuple[int, int]


_CARDS = (
    Card("RTX 3060", int(11.76 * GIB), (8, 6)),
    Card("RTX 3090", int(23.57 * GIB), (8, 6)),
    Card("RTX 4090", int(23.52 * GIB), (8, 9)),
    Card("RTX 5090", int(31.36 * GIB), (12, 0)),
    Card("A10", int(22.07 * GIB), (8, 6)),
    Card("L4", int(22.03 * GIB), (8, 9)),
    Card("L40S", int(44.39 * GIB), (8, 9)),
    Card("A100 40GB", int(39.39 * GIB), (8, 0)),
    Card("A100 80GB", int(79.15 * GIB), (8, 0)),
    Card("H100", int(79.11 * GIB), (9, 0)),
    Card("H200", int(139.8 * GIB), (9, 0)),
)
CARDS: dict[str, Card] = {c.name: c for c in _CARDS}


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_card(name: str) -> Card:
    """The card called ``name`` (case, spaces and dashes ignored; a vendor prefix such as
    "NVIDIA GeForce" too); ValueError naming the ones known."""
    key = _key(name)
    for prefix in ("nvidiageforce", "nvidia", "geforce"):
        key = key.removeprefix(prefix)
    for card in _CARDS:
        if _key(card.name) == key:
            return card
    raise ValueError(f"gpu: unknown card {name!r}; known: {', '.join(CARDS)}")
