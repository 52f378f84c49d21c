"""The segmentation refiner's mask work on the host (no CUDA): the coarse path's raster, the
crop around the box, the clean-up of the refined mask and its tracing back into a path, as
the model author's engine does them (its OpenCV and potrace calls, in NumPy here).

- `coarse_mask`: the path's polygons filled at twice the picture's size, each pixel the mean
  of its four samples, kept above one half.
- `expand_box`: the box widened by a quarter of its size on each side, in whole pixels
  (truncated), clipped to the picture.
- `clean_mask`: background components (8-connected) smaller than 0.15% of the picture are
  filled, then foreground components that small are dropped (the largest stays if all are),
  then a 3x3 closing whose erosion treats the outside as foreground.
- `trace`: potrace (turdsize 2, alphamax 1, opttolerance 0.2) over the mask; each curve as
  ``M x,y`` then ``L c L end`` for a corner or ``C c1,c2,end`` for a curve, then ``z``, with
  coordinates relative to the mask's own box (three decimals, leading zeros dropped), and that
  box (pixel-inclusive, normalized).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from decoding.segment_output import Point, rasterize

Box = tuple[float, float, float, float]
PixelBox = tuple[int, int, int, int]
AREA_FRACTION = 0.0015
MARGIN = 0.25


def coarse_mask(
    polygons: list[list[Point]], width: int, height: int, window: PixelBox | None = None
) -> np.ndarray:
    """Bool [height, width]: the polygons (normalized) at 2x supersampling, over one half;
    ``window`` (x1, y1, x2, y2 pixels): only that part of it, drawn alone (the same pixels:
    the fine grid moves by whole samples)."""
    x1, y1, x2, y2 = window or (0, 0, width, height)
    w, h = x2 - x1, y2 - y1
    moved = [[((x * width - x1) / w, (y * height - y1) / h) for x, y in p] for p in polygons]
    fine = rasterize(moved, 2 * w, 2 * h).astype(np.float32)
    return fine.reshape(h, 2, w, 2).mean(axis=(1, 3)) > 0.5


def expand_box(box: Box, width: int, height: int, margin: float = MARGIN) -> PixelBox:
    """(x1, y1, x2, y2) pixels: the normalized box widened by ``margin`` of its size."""
    x0, y0, x1, y1 = box[0] * width, box[1] * height, box[2] * width, box[3] * height
    dx, dy = (x1 - x0) * margin, (y1 - y0) * margin
    return (
        max(0, int(x0 - dx)), max(0, int(y0 - dy)),
        min(width, int(x1 + dx)), min(height, int(y1 + dy)),
    )  # fmt: skip


def components(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """8-connected components of a bool mask: (labels [H, W] int32, 0 the background and
    1.. the components in first-pixel order, sizes [n + 1] with the background's first).
    Runs of each row are joined to the overlapping runs of the row above (union-find)."""
    h, w = mask.shape
    runs: list[tuple[int, int, int]] = []  # (row, start, end) per run, rows in order
    row_start = [0] * (h + 1)
    padded = np.zeros((h, w + 2), np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    for y in range(h):
        starts = np.flatnonzero(edges[y] == 1)
        ends = np.flatnonzero(edges[y] == -1)
        runs.extend((y, int(s), int(e)) for s, e in zip(starts, ends, strict=True))
        row_start[y + 1] = len(runs)
    parent = list(range(len(runs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for y in range(1, h):
        above = range(row_start[y - 1], row_start[y])
        j = above.start
        for i in range(row_start[y], row_start[y + 1]):
            _, s, e = runs[i]
            # runs above touching [s - 1, e] (8-connectivity): end > s - 1 and start < e + 1
            while j < above.stop and runs[j][2] < s:
                j += 1
            k = j
            while k < above.stop and runs[k][1] <= e:
                ri, rk = find(i), find(k)
                if ri != rk:
                    parent[max(ri, rk)] = min(ri, rk)
                k += 1
    labels = np.zeros((h, w), np.int32)
    ids: dict[int, int] = {}
    sizes = [int(h * w - mask.sum())]
    for i, (y, s, e) in enumerate(runs):
        root = find(i)
        if root not in ids:
            ids[root] = len(ids) + 1
            sizes.append(0)
        label = ids[root]
        labels[y, s:e] = label
        sizes[label] += e - s
    return labels, np.array(sizes, np.int64)


Edges = tuple[bool, bool, bool, bool]  # top, bottom, left, right
CLOSED: Edges = (False, False, False, False)


def _close3(mask: np.ndarray) -> np.ndarray:
    """3x3 closing: dilation with the outside as background, erosion with it as foreground
    (a window's open edge keeps two empty rows, so its erosion there is the picture's)."""
    h, w = mask.shape
    dil = np.zeros((h + 2, w + 2), bool)
    for dy in range(3):
        for dx in range(3):
            dil[dy : dy + h, dx : dx + w] |= mask
    dil = dil[1:-1, 1:-1]
    ero = np.ones_like(mask)
    padded = np.ones((h + 2, w + 2), bool)
    padded[1:-1, 1:-1] = dil
    for dy in range(3):
        for dx in range(3):
            ero &= padded[dy : dy + h, dx : dx + w]
    return ero


def clean_mask(
    mask: np.ndarray,
    area_fraction: float = AREA_FRACTION,
    *,
    area: int | None = None,
    open_edges: Edges = CLOSED,
) -> np.ndarray:
    """Holes, then islands, smaller than ``area_fraction`` of the picture removed; closed.
    A window of a larger picture passes the picture's ``area`` and which of its edges lie
    inside the picture (``open_edges``): background reaching one is the picture's outer
    background, never a hole, as long as the window keeps a pixel of empty margin there."""
    h, w = mask.shape
    small_area = max(1.0, area_fraction * (area or h * w))
    for holes in (True, False):
        labels, sizes = components(~mask if holes else mask)
        if holes and any(open_edges):
            top, bottom, left, right = open_edges
            edges = [labels[0] if top else [], labels[-1] if bottom else []]
            edges += [labels[:, 0] if left else [], labels[:, -1] if right else []]
            outside = np.unique(np.concatenate([np.asarray(e, np.int32) for e in edges]))
            sizes = sizes.copy()
            sizes[outside[outside > 0]] = np.iinfo(np.int64).max
        small = np.flatnonzero(sizes[1:] < small_area) + 1
        if not small.size:
            continue
        if holes:
            mask = mask | np.isin(labels, small)
        else:
            keep = np.setdiff1d(np.arange(1, sizes.size), small)
            if not keep.size:
                keep = np.array([int(np.argmax(sizes[1:])) + 1])
            mask = np.isin(labels, keep)
    return _close3(mask)


def mask_box(mask: np.ndarray) -> PixelBox | None:
    """Inclusive (x0, y0, x1, y1) of the mask's pixels; None when it is empty."""
    ys, xs = np.nonzero(mask)
    if not xs.size:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())


def _num(v: float) -> str:
    return f"{v:.3f}".replace("0.", ".").replace("-.", "-0.")


@dataclass(frozen=True)
class Traced:
    """A traced mask: its box (normalized), the path in that box's frame (the author's
    format), the path in the picture's normalized coordinates (five decimals, as the coarse
    result writes it) and its polygons there (curves sampled at even steps)."""

    box: Box
    box_path: str
    path: str
    polygons: list[list[Point]]


def _bezier(p0: Point, p1: Point, p2: Point, p3: Point, segments: int) -> list[Point]:
    t = np.linspace(0.0, 1.0, segments + 1)[1:, None]
    pts = np.array([p0, p1, p2, p3])
    out = (1 - t) ** 3 * pts[0] + 3 * (1 - t) ** 2 * t * pts[1] + 3 * (1 - t) * t**2 * pts[2]
    out += t**3 * pts[3]
    return [(float(x), float(y)) for x, y in out]


def trace(
    mask: np.ndarray,
    curve_segments: int = 8,
    origin: tuple[int, int] = (0, 0),
    size: tuple[int, int] | None = None,
) -> Traced | None:
    """The mask traced (see the module docstring); None when it is empty or traces to
    nothing. A window of a larger picture passes where it lies (``origin``, x and y pixels)
    and the picture's (width, height) ``size``. Needs potracer (``pip install potracer``)."""
    import potrace  # potracer: pure Python

    found = mask_box(mask)
    if found is None:
        return None
    ox, oy = origin
    w, h = size or (mask.shape[1], mask.shape[0])
    x0, y0, x1, y1 = found
    x0, y0, x1, y1 = x0 + ox, y0 + oy, x1 + ox, y1 + oy
    bw, bh = (x1 - x0 + 1) / w, (y1 - y0 + 1) / h
    left, top = x0 / w, y0 / h

    def norm(p: object) -> Point:
        return ((p.x + ox) / w, (p.y + oy) / h)  # type: ignore[attr-defined]

    def rel(p: Point) -> str:
        return f"{_num((p[0] - left) / bw)},{_num((p[1] - top) / bh)}"

    def img(*pts: Point) -> str:
        return " ".join(f"{x:.5f} {y:.5f}" for x, y in pts)

    # potracer traces the dark pixels of an image: the mask's complement, as booleans.
    curves = potrace.Bitmap(~mask.astype(bool)).trace(
        turdsize=2, alphamax=1.0, opticurve=True, opttolerance=0.2
    )
    box_parts: list[str] = []
    parts: list[str] = []
    polygons: list[list[Point]] = []
    for curve in curves:
        cur = norm(curve.start_point)
        box_parts.append(f"M{rel(cur)}")
        parts.append(f"M {img(cur)}")
        polygon = [cur]
        for seg in curve.segments:
            end = norm(seg.end_point)
            if seg.is_corner:
                c = norm(seg.c)
                box_parts.append(f"L{rel(c)}L{rel(end)}")
                parts.append(f"L {img(c)} L {img(end)}")
                polygon += [c, end]
            else:
                c1, c2 = norm(seg.c1), norm(seg.c2)
                box_parts.append(f"C{rel(c1)},{rel(c2)},{rel(end)}")
                parts.append(f"C {img(c1, c2, end)}")
                polygon += _bezier(cur, c1, c2, end, curve_segments)
            cur = end
        box_parts.append("z")
        parts.append("Z")
        polygons.append(polygon)
    if not polygons:
        return None
    box = (left, top, (x1 + 1) / w, (y1 + 1) / h)
    return Traced(box, "".join(box_parts), " ".join(parts), polygons)


def finish_window(
    window: np.ndarray,
    area: int,
    open_edges: Edges,
    origin: tuple[int, int],
    size: tuple[int, int],
) -> tuple[np.ndarray, Traced | None]:
    """A refined window of the picture, cleaned and traced (`clean_mask`, `trace`): the
    Python-heavy half of the mask work, which a child process runs (`MaskProcess`)."""
    window = clean_mask(window, area=area, open_edges=open_edges)
    return window, (trace(window, origin=origin, size=size) if window.any() else None)


class MaskProcess:
    """`finish_window` in a child process of its own (spawned on first use, replaced if it
    dies), so that tracing, pure Python, never holds the engine's GIL."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: object) -> tuple[np.ndarray, Traced | None]:
        """`finish_window(*args)`, answered by the child."""
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
            pool = self._pool
        try:
            return pool.submit(finish_window, *args).result()
        except BrokenProcessPool:
            with self._lock:  # the next call starts a fresh child
                if self._pool is pool:
                    self._pool = None
            raise

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(cancel_futures=True)
