"""libvips' ``resize(hscale, vscale=...)`` on uint8 images, as a resampling plan.

Replicates the default path (kernel lanczos3, gap 2.0) of libvips 8.17/8.18, which the
moondream reference runs when pyvips is installed:

1. an axis that shrinks: an integer box pre-shrink by ``floor(in / out / 2)`` when that
   is at least 2 (``shrinkv``/``shrinkh``), then a lanczos3 reduce by the residual
   factor (``reducev``/``reduceh``); vertical first, then horizontal;
2. an axis that grows: an affine transform with Catmull-Rom (``bicubic``) interpolation
   at input coordinate ``x / scale - 0.5``. When only one axis grows, the other goes
   through the same affine with scale 1, i.e. it is resampled half a pixel off.

The tables follow libvips: masks tabulated at 1/64 pixel steps in double precision,
truncated to 12-bit fixed point; positions computed in double as libvips computes them.
libvips up to 8.16 divided exactly in the box pre-shrink; 8.17 and later use the
multiply-shift of :class:`BoxShrink`. The two differ by at most a couple of units when a
pre-shrink happens (inputs more than 4x the output size).
"""

from __future__ import annotations

import functools
import math

from .resample_plan import COLS, ROWS, BoxShrink, Filter, Plan, Stage

__all__ = ["vips_resize_plan"]

_GAP = 2.0
_TRANSFORM_SCALE = 64  # sub-pixel positions per pixel in the mask tables
_SHIFT = 12  # fixed-point fraction bits of the masks
_ONE = 1 << _SHIFT


def _c_trunc(value: float) -> int:
    """C's double -> int conversion (toward zero)."""
    return int(value)


def _round_uint(value: float) -> int:
    """``VIPS_ROUND_UINT``: ``(int) (v + 0.5)``."""
    return int(value + 0.5)


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos3(x: float) -> float:
    if -3 <= x <= 3:
        return _sinc(x) * _sinc(x / 3)
    return 0.0


def _reduce_mask(n_points: int, shrink: float, x: float) -> list[int]:
    """Lanczos3 mask of ``n_points`` taps at sub-pixel offset ``x`` (``calculate_coefficients``)."""
    half = x + n_points / 2.0 - 1
    taps = []
    total = 0.0
    for i in range(n_points):
        value = _lanczos3((i - half) / shrink)
        taps.append(value)
        total += value
    return [_c_trunc(value / total * _ONE) for value in taps]


def _catmull_mask(x: float) -> list[int]:
    """Catmull-Rom weights for offset ``x`` in the order libvips computes them."""
    cr1 = 1.0 - x
    cr2 = -0.5 * x
    cr3 = cr1 * cr2
    cone = cr1 * cr3
    cfou = x * cr3
    cr4 = cfou - cone
    ctwo = cr1 - cone + cr4
    cthr = x - cfou - cr4
    return [_c_trunc(c * _ONE) for c in (cone, ctwo, cthr, cfou)]


_CATMULL = [_catmull_mask(t / _TRANSFORM_SCALE) for t in range(_TRANSFORM_SCALE + 1)]


def _mask_index(position: float) -> int:
    """Nearest of the ``_TRANSFORM_SCALE + 1`` tabulated sub-pixel offsets of ``position``."""
    sub = _c_trunc(position * _TRANSFORM_SCALE * 2) & (_TRANSFORM_SCALE * 2 - 1)
    return (sub + 1) >> 1


def _reduce_axis(axis: int, in_len: int, shrink: float) -> tuple[list[Stage], int]:
    """``reducev``/``reduceh`` with gap 2: stages and the output length."""
    out_len = _round_uint(in_len / shrink)
    extra = out_len * shrink - in_len
    stages: list[Stage] = []
    int_shrink = max(1, math.floor(in_len / out_len / _GAP))
    if int_shrink > 1:
        box = BoxShrink(axis, int_shrink, in_len)
        stages.append(box)
        in_len = box.out_len
        shrink /= int_shrink
        extra /= int_shrink
    if shrink == 1.0:
        return stages, in_len
    n_points = 2 * round(3 * shrink) + 1  # rint: round half to even, like Python's round
    offset = (1 + extra) / 2.0 - 1
    masks = [
        _reduce_mask(n_points, shrink, t / _TRANSFORM_SCALE) for t in range(_TRANSFORM_SCALE + 1)
    ]
    pad = math.ceil(n_points / 2.0) - 1
    rows: list[dict[int, int]] = []
    top = (0 + 0.5) * shrink - 0.5 - offset
    position = top
    for o in range(out_len):
        # libvips walks along a line adding the shrink; it starts every region (strips
        # as wide as the image for columns, arbitrary heights for rows) from the formula.
        if axis == ROWS:
            position = (o + 0.5) * shrink - 0.5 - offset
        base = _c_trunc(position)
        mask = masks[_mask_index(position)]
        row: dict[int, int] = {}
        for i, w in enumerate(mask):
            src = min(max(base + i - pad, 0), in_len - 1)
            row[src] = row.get(src, 0) + w
        rows.append(row)
        position += shrink
    stages.append(Filter.from_rows(axis, in_len, rows, _SHIFT, clip=True))
    return stages, out_len


def _affine_axis(axis: int, in_len: int, scale: float, inverse: float, clip: bool) -> Filter:
    """One axis of ``affine`` with the bicubic interpolator, idx/idy 0.5, extend copy."""
    out_len = _round_uint(scale * in_len)
    rows: list[dict[int, int]] = []
    # Input coordinates live in a copy padded by 2 pixels (interpolator window offset 1,
    # plus the 1 pixel border affine adds); 1.5 = 0.5 (idx) + 1 (window offset).
    position = 1.5
    for o in range(out_len):
        if axis == ROWS:
            position = (inverse * o + 0.5) + 1.0
        base = _c_trunc(position)
        mask = _CATMULL[_mask_index(position)]
        row: dict[int, int] = {}
        for j, w in enumerate(mask):
            src = min(max(base - 3 + j, 0), in_len - 1)
            row[src] = row.get(src, 0) + w
        rows.append(row)
        position += inverse
    return Filter.from_rows(axis, in_len, rows, _SHIFT, clip=clip)


@functools.lru_cache(maxsize=256)
def vips_resize_plan(in_size: tuple[int, int], scale: tuple[float, float]) -> Plan:
    """The plan of ``vips_resize(image, hscale, vscale=vscale)``.

    Args:
        in_size: ``(height, width)`` of the input.
        scale: ``(vscale, hscale)``, output over input size per axis, as the caller
            passes them to libvips (e.g. ``378 / height``).
    """
    height, width = in_size
    vscale, hscale = scale
    # Don't let either axis drop below 1 px.
    hscale = max(hscale, 1.0 / width)
    vscale = max(vscale, 1.0 / height)
    stages: list[Stage] = []
    if vscale < 1.0:
        more, height = _reduce_axis(ROWS, height, 1.0 / vscale)
        stages += more
    if hscale < 1.0:
        more, width = _reduce_axis(COLS, width, 1.0 / hscale)
        stages += more
    if hscale > 1.0 or vscale > 1.0:
        a = hscale if hscale > 1.0 else 1.0
        d = vscale if vscale > 1.0 else 1.0
        inv_det = 1.0 / (a * d - 0.0 * 0.0)
        horizontal = _affine_axis(COLS, width, a, inv_det * d, clip=False)
        vertical = _affine_axis(ROWS, height, d, inv_det * a, clip=True)
        stages += [horizontal, vertical]
        height, width = vertical.out_len, horizontal.out_len
    return Plan(in_size, (height, width), tuple(stages))
