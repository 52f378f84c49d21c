"""The load generator's workloads (fixed output limits), levels (closed-loop concurrency or
open-loop rate) and scenarios (a workload on pictures of one size and mode), and their parsing."""

from __future__ import annotations

from dataclasses import dataclass

from bench.synth_images import parse_size


@dataclass(frozen=True)
class Workload:
    """One kind of request with fixed output limits."""

    name: str
    rpc: str  # query | caption | point | detect | segment
    streamed: bool
    max_tokens: int | None = None
    max_objects: int | None = None
    question: str = ""
    reasoning: bool = False
    regex: str | None = None


def workloads(segment_tokens: int) -> dict[str, Workload]:
    """The named workloads; ``segment_tokens`` caps the outline's path tokens."""
    items = [
        Workload("query3", "query", True, max_tokens=3, question="What is in this image?"),
        Workload(
            "query30",
            "query",
            True,
            max_tokens=30,
            question="Describe the main object in this image and explain your reasoning.",
        ),
        Workload(
            "reason64",
            "query",
            True,
            max_tokens=67,
            question="How many objects are in this image?",
            reasoning=True,
            regex="[0-9] [0-9] [0-9]",
        ),
        Workload("caption64", "caption", True, max_tokens=64),
        Workload("caption128", "caption", True, max_tokens=128),
        Workload("point5", "point", False, max_objects=5),
        Workload("detect5", "detect", False, max_objects=5),
        Workload("segment", "segment", False, max_tokens=segment_tokens),
    ]
    return {w.name: w for w in items}


@dataclass(frozen=True)
class Level:
    """A closed-loop concurrency (``kind`` "closed") or an open-loop rate ("open", req/s)."""

    kind: str
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "closed" else f"r={self.value:g}/s"


@dataclass(frozen=True)
class Scenario:
    workload: Workload
    size: tuple[int, int]
    mode: str  # unique | repeated
    levels: tuple[Level, ...]

    @property
    def name(self) -> str:
        return f"{self.workload.name}/{self.size[0]}x{self.size[1]}/{self.mode}"


def parse_levels(text: str) -> tuple[Level, ...]:
    """``"c1,c4,r2.5"`` -> closed loop at 1 and 4, open loop at 2.5 req/s."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if len(item) < 2 or item[0] not in "cr":
            raise ValueError(f"a level is cN (concurrency) or rX (req/s), not {item!r}")
        if item[0] == "c":
            out.append(Level("closed", int(item[1:])))
        else:
            out.append(Level("open", float(item[1:])))
        if out[-1].value <= 0:
            raise ValueError(f"a level must be positive, not {item!r}")
    return tuple(out)


def parse_scenario(
    text: str, known: dict[str, Workload], default_levels: tuple[Level, ...]
) -> Scenario:
    """``WORKLOAD[:WxH[:unique|repeated[:LEVELS]]]``, e.g. ``query3:800x600:unique:c1,c16``."""
    parts = text.split(":")
    if parts[0] not in known:
        raise ValueError(f"unknown workload {parts[0]!r}; choose from {sorted(known)}")
    size = parse_size(parts[1]) if len(parts) > 1 and parts[1] else (800, 600)
    mode = parts[2] if len(parts) > 2 and parts[2] else "unique"
    if mode not in ("unique", "repeated"):
        raise ValueError(f"image mode must be unique or repeated, not {mode!r}")
    levels = parse_levels(parts[3]) if len(parts) > 3 and parts[3] else default_levels
    return Scenario(known[parts[0]], size, mode, levels)
