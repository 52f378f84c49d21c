"""How alike two models' answers are (``vlm compare``): per task, the share of identical
answers, the mean box IoU (detect) and the mean point distance (point), boxes and points of
one picture matched greedily, the closest pair first. Pure functions of the answers' bodies
(the Moondream API's: ``caption``, ``answer``, ``objects``, ``points``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Box = tuple[float, float, float, float]  # x_min, y_min, x_max, y_max, in [0, 1]
Point = tuple[float, float]

# The member of each task's answer that is compared.
ANSWER_KEYS = {"caption": "caption", "query": "answer", "detect": "objects", "point": "points"}


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes (0 when either is empty)."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, w) * max(0.0, h)
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0 else 0.0


def _area(b: Box) -> float:
    return max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])


def matched_iou(a: Sequence[Box], b: Sequence[Box]) -> float:
    """Mean IoU of one picture's two box lists, paired greedily (highest IoU first); a box
    left without a partner counts 0, so a different count lowers it. Both empty: 1."""
    if not a and not b:
        return 1.0
    pairs = sorted(
        ((box_iou(x, y), i, j) for i, x in enumerate(a) for j, y in enumerate(b)), reverse=True
    )
    total = sum(iou for iou, _, _ in _greedy(pairs))
    return total / max(len(a), len(b))


def matched_distances(a: Sequence[Point], b: Sequence[Point]) -> tuple[list[float], int]:
    """One picture's two point lists paired greedily (closest first): the pairs' distances
    (in picture fractions) and how many points were left without a partner."""
    pairs = sorted((math.dist(x, y), i, j) for i, x in enumerate(a) for j, y in enumerate(b))
    found = [d for d, _, _ in _greedy(pairs)]
    return found, abs(len(a) - len(b))


def _greedy(pairs: list[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
    """Pairs taken in order (``pairs`` is sorted best first), each item used once."""
    used_a: set[int] = set()
    used_b: set[int] = set()
    out = []
    for score, i, j in pairs:
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            out.append((score, i, j))
    return out


@dataclass(frozen=True)
class TaskScore:
    """How alike two models' answers of one task are over the pictures both answered."""

    task: str
    pictures: int  # answered by both
    identical: float  # share of identical answers
    mean_iou: float | None = None  # detect
    mean_point_distance: float | None = None  # point: over matched pairs
    unmatched_points: int = 0  # point: left without a partner
    failed: int = 0  # pictures one model or both failed on


def _boxes(body: Mapping[str, Any]) -> list[Box]:
    return [(o["x_min"], o["y_min"], o["x_max"], o["y_max"]) for o in body["objects"]]


def _points(body: Mapping[str, Any]) -> list[Point]:
    return [(p["x"], p["y"]) for p in body["points"]]


def score_task(
    task: str, a: Mapping[str, Mapping[str, Any]], b: Mapping[str, Mapping[str, Any]], total: int
) -> TaskScore:
    """Score ``task``'s answers ``a`` and ``b`` (picture -> answer body; a picture missing
    from either failed there) over ``total`` pictures."""
    key = ANSWER_KEYS[task]
    both = [p for p in a if p in b]
    failed = total - len(both)
    if not both:
        return TaskScore(task, 0, 0.0, failed=failed)
    same = sum(1 for p in both if a[p][key] == b[p][key]) / len(both)
    if task == "detect":
        iou = sum(matched_iou(_boxes(a[p]), _boxes(b[p])) for p in both) / len(both)
        return TaskScore(task, len(both), same, mean_iou=iou, failed=failed)
    if task == "point":
        distances: list[float] = []
        unmatched = 0
        for p in both:
            found, left = matched_distances(_points(a[p]), _points(b[p]))
            distances += found
            unmatched += left
        mean = sum(distances) / len(distances) if distances else None
        return TaskScore(task, len(both), same, None, mean, unmatched, failed)
    return TaskScore(task, len(both), same, failed=failed)
