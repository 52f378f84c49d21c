"""Geometry of Moondream 3's segment path: its box, polygons, mask and image-space path text.

The box is the model's centre plus and minus half its size, each clamped to [0, 1] first and
the corners then clamped to the picture, as the model author's engine reports it; the path's
frame is that box (svg_tokens.py: 0 at its left or top edge, 1 at its right or bottom edge).

The path is read by SVG's rules -- absolute and relative commands, H and V, smooth curves
reflecting the previous control point, elliptical arcs (SVG's endpoint-to-centre conversion,
radii scaled up when too small) -- and flattened in the box's frame, curves and arcs sampled at
`curve_segments` even steps, then mapped into the picture: x = x_min + u * (x_max - x_min),
likewise y. Each moveto starts a polygon, and so does drawing on after Z (from the closed
subpath's start); the mask is their filled union (segment_output.py). The image-space path
text maps every command the same way (five decimals, as Moondream 2's segment writes it); an
arc's ellipse goes through the box's scaling, so its radii and rotation change when the box is
not square.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .segment_output import Point, SegmentResult, rasterize, rle_encode
from .svg_tokens import PathGroup, chunk_texts, path_text

Box = tuple[float, float, float, float]


def _unit(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def clamped_box(center: Point, size: Point) -> Box:
    """(x_min, y_min, x_max, y_max) of a decoded centre and size, clamped to the picture."""
    cx, cy, w, h = _unit(center[0]), _unit(center[1]), _unit(size[0]), _unit(size[1])
    return (max(cx - w / 2, 0.0), max(cy - h / 2, 0.0), min(cx + w / 2, 1.0), min(cy + h / 2, 1.0))


def flatten(groups: Sequence[PathGroup], segments: int = 8) -> list[list[Point]]:
    """The path's polygons in its own frame (see the module docstring)."""
    polygons: list[list[Point]] = []
    cur = start = (0.0, 0.0)
    control: Point | None = None  # the last curve's second control point (S and T reflect it)
    last, closed = "", False
    for group in groups:
        cmd = group.command
        kind, v = cmd.upper(), group.values()
        ox, oy = cur if cmd.islower() else (0.0, 0.0)

        def pt(i: int, ox: float = ox, oy: float = oy, v: tuple[float, ...] = v) -> Point:
            return (ox + v[i], oy + v[i + 1])

        if kind == "M":
            cur = start = pt(0)
            polygons.append([cur])
            closed, control, last = False, None, kind
            continue
        if kind == "Z":
            cur, closed, control, last = start, True, None, kind
            continue
        if closed or not polygons:  # drawing on after Z starts a subpath at its start
            polygons.append([cur])
            closed = False
        reflected = (2 * cur[0] - control[0], 2 * cur[1] - control[1]) if control else cur
        new_control: Point | None = None
        if kind == "L":
            added = [pt(0)]
        elif kind == "H":
            added = [(ox + v[0], cur[1])]
        elif kind == "V":
            added = [(cur[0], oy + v[0])]
        elif kind in "CS":
            c1 = pt(0) if kind == "C" else (reflected if last in ("C", "S") else cur)
            rest = [pt(2), pt(4)] if kind == "C" else [pt(0), pt(2)]
            added = _bezier([cur, c1, *rest], segments)
            new_control = rest[0]
        elif kind in "QT":
            c = pt(0) if kind == "Q" else (reflected if last in ("Q", "T") else cur)
            added = _bezier([cur, c, pt(2) if kind == "Q" else pt(0)], segments)
            new_control = c
        else:  # A
            added = _arc(cur, v[0], v[1], v[2], bool(v[3]), bool(v[4]), pt(5), segments)
        polygons[-1].extend(added)
        if added:
            cur = added[-1]
        control, last = new_control, kind
    return polygons


def _bezier(control: list[Point], segments: int) -> list[Point]:
    """Points of a Bezier curve at t = 1/segments .. 1 (its start left out)."""
    c = np.array(control, dtype=np.float64)
    t = np.linspace(0.0, 1.0, segments + 1)[1:, None]
    degree = len(c) - 1
    out = sum(math.comb(degree, k) * (1 - t) ** (degree - k) * t**k * c[k] for k in range(len(c)))
    points = [(float(x), float(y)) for x, y in np.asarray(out)]
    points[-1] = control[-1]  # exactly the end point: the next command starts there
    return points


def _angle(ux: float, uy: float, vx: float, vy: float) -> float:
    return math.atan2(ux * vy - uy * vx, ux * vx + uy * vy)


def _arc(
    p0: Point, rx: float, ry: float, degrees: float, large: bool, sweep: bool, p1: Point, n: int
) -> list[Point]:
    """Points of an SVG elliptical arc from p0 to p1 (its start left out)."""
    if p0 == p1:
        return []
    rx, ry = abs(rx), abs(ry)
    if rx == 0 or ry == 0:
        return [p1]
    phi = math.radians(degrees)
    cos, sin = math.cos(phi), math.sin(phi)
    dx, dy = (p0[0] - p1[0]) / 2, (p0[1] - p1[1]) / 2
    x1, y1 = cos * dx + sin * dy, -sin * dx + cos * dy
    grow = x1 * x1 / (rx * rx) + y1 * y1 / (ry * ry)
    if grow > 1:
        rx, ry = rx * math.sqrt(grow), ry * math.sqrt(grow)
    num = rx * rx * ry * ry - rx * rx * y1 * y1 - ry * ry * x1 * x1
    den = rx * rx * y1 * y1 + ry * ry * x1 * x1
    root = math.sqrt(max(0.0, num / den)) * (-1 if large == sweep else 1)
    cxp, cyp = root * rx * y1 / ry, -root * ry * x1 / rx
    cx = cos * cxp - sin * cyp + (p0[0] + p1[0]) / 2
    cy = sin * cxp + cos * cyp + (p0[1] + p1[1]) / 2
    ux, uy = (x1 - cxp) / rx, (y1 - cyp) / ry
    theta = _angle(1.0, 0.0, ux, uy)
    delta = _angle(ux, uy, (-x1 - cxp) / rx, (-y1 - cyp) / ry)
    if not sweep and delta > 0:
        delta -= 2 * math.pi
    elif sweep and delta < 0:
        delta += 2 * math.pi
    points = []
    for k in range(1, n + 1):
        a = theta + delta * k / n
        ex, ey = rx * math.cos(a), ry * math.sin(a)
        points.append((cx + cos * ex - sin * ey, cy + sin * ex + cos * ey))
    points[-1] = p1
    return points


def _scaled_ellipse(
    rx: float, ry: float, degrees: float, w: float, h: float
) -> tuple[float, float, float]:
    """Radii and rotation (degrees) of the ellipse (rx, ry, rotated by ``degrees``) scaled by
    (w, h): the singular values and first left vector of S R D. S keeps orientation (w, h >= 0),
    so the arc's flags stay as they are."""
    phi = math.radians(degrees)
    m = np.array(
        [
            [w * math.cos(phi) * rx, -w * math.sin(phi) * ry],
            [h * math.sin(phi) * rx, h * math.cos(phi) * ry],
        ]
    )
    u, sig, _ = np.linalg.svd(m)
    return float(sig[0]), float(sig[1]), math.degrees(math.atan2(u[1, 0], u[0, 0]))


def image_path(groups: Sequence[PathGroup], box: Box) -> str:
    """The path in the picture's normalized coordinates, every command written out."""
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    parts: list[str] = []
    for group in groups:
        cmd = group.command
        v, rel = group.values(), cmd.islower()
        kind = cmd.upper()

        def x(u: float, rel: bool = rel) -> float:
            return u * w if rel else x0 + u * w

        def y(u: float, rel: bool = rel) -> float:
            return u * h if rel else y0 + u * h

        if kind == "H":
            values = [x(v[0])]
        elif kind == "V":
            values = [y(v[0])]
        elif kind == "A":
            rx, ry, rot = _scaled_ellipse(v[0], v[1], v[2], w, h)
            values = [rx, ry, rot, x(v[5]), y(v[6])]
        else:
            values = [x(v[i]) if i % 2 == 0 else y(v[i]) for i in range(len(v))]
        text = [f"{value:.5f}" for value in values]
        if kind == "A":
            text[3:3] = [str(int(v[3])), str(int(v[4]))]
        parts.append(" ".join([cmd, *text]))
    return " ".join(parts)


def build_box_segment(
    center: Point,
    size: Point,
    groups: Sequence[PathGroup],
    image_size: tuple[int, int],
    curve_segments: int = 8,
) -> SegmentResult:
    """The segment result of a decoded box and a parsed path, for a picture of (width,
    height) pixels."""
    box = clamped_box(center, size)
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    polygons = [
        [(x0 + u * w, y0 + v * h) for u, v in polygon]
        for polygon in flatten(groups, curve_segments)
    ]
    width, height = image_size
    return SegmentResult(
        box=box,
        path=image_path(groups, box),
        polygons=polygons,
        mask_size=(height, width),
        mask_counts=rle_encode(rasterize(polygons, width, height)),
        box_path=path_text(groups),
        chunks=tuple(chunk_texts(groups)),
        points=((_unit(center[0]), _unit(center[1])),),
    )
