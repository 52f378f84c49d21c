"""Pillow's ``Image.resize(size, LANCZOS)`` on RGB images, as a resampling plan.

Replicates ``ImagingResample``: per axis, lanczos3 coefficients computed in double and
rounded to 22-bit fixed point, the horizontal pass first, then the vertical one, each
rounded and clipped to uint8. This is what the pipeline produced before it resized in
torch, and the moondream reference's fallback when pyvips is missing.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import PIL
from PIL import Image

from .resample_plan import COLS, ROWS, Filter, Plan, Stage

__all__ = ["pillow_resize_plan"]

_SHIFT = 32 - 8 - 2  # PRECISION_BITS
_SUPPORT = 3.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    if -3.0 <= x < 3.0:
        return _sinc(x) * _sinc(x / 3)
    return 0.0


def _fixed(value: float) -> int:
    """``normalize_coeffs_8bpc``: round half away from zero, then truncate."""
    scaled = value * (1 << _SHIFT)
    return int(-0.5 + scaled) if value < 0 else int(0.5 + scaled)


@functools.lru_cache(maxsize=512)
def _axis(axis: int, in_len: int, out_len: int) -> Filter:
    """``precompute_coeffs`` for the box ``(0, in_len)``."""
    scale = in_len / out_len
    filterscale = max(scale, 1.0)
    support = _SUPPORT * filterscale
    inv_filterscale = 1.0 / filterscale
    rows: list[dict[int, int]] = []
    for o in range(out_len):
        center = (o + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_len) - xmin
        taps = [_lanczos((x + xmin - center + 0.5) * inv_filterscale) for x in range(xmax)]
        total = 0.0
        for t in taps:
            total += t
        if total != 0.0:
            taps = [t / total for t in taps]
        rows.append({xmin + x: _fixed(t) for x, t in enumerate(taps)})
    return Filter.from_rows(axis, in_len, rows, _SHIFT, clip=True)


def pillow_resize_plan(in_size: tuple[int, int], out_size: tuple[int, int]) -> Plan:
    """The plan of ``image.resize((out_w, out_h), LANCZOS)``; sizes are ``(height, width)``."""
    (in_h, in_w), (out_h, out_w) = in_size, out_size
    stages: list[Stage] = []
    if out_w != in_w:
        stages.append(_axis(COLS, in_w, out_w))
    if out_h != in_h:
        stages.append(_axis(ROWS, in_h, out_h))
    if len(stages) == 2 and _vertical_first(in_size, out_size):
        stages.reverse()
    return Plan(in_size, out_size, tuple(stages))


@functools.lru_cache(maxsize=512)
def _vertical_first(in_size: tuple[int, int], out_size: tuple[int, int]) -> bool:
    """Whether the installed Pillow runs the vertical pass first for these sizes.

    The passes round in between, so the order shows in the result. Pillow up to 12
    always went horizontal first; Pillow 13 picks an order per size pair (always
    vertical first when only the height shrinks, always horizontal first when the
    height grows, either when both shrink). Where it may vary, one resize of a
    grey probe image of the same size tells which order this Pillow takes.
    """
    (in_h, in_w), (out_h, out_w) = in_size, out_size
    if out_h >= in_h:
        return False
    if out_w >= in_w:
        return int(PIL.__version__.split(".")[0]) >= 13
    rng = np.random.default_rng(in_h * 65_537 + in_w)
    probe = Image.fromarray(rng.integers(0, 256, (in_h, in_w), dtype=np.uint8))
    lanczos = Image.Resampling.LANCZOS
    both = np.asarray(probe.resize((out_w, out_h), lanczos))
    by_rows = probe.resize((in_w, out_h), lanczos).resize((out_w, out_h), lanczos)
    by_cols = probe.resize((out_w, in_h), lanczos).resize((out_w, out_h), lanczos)
    return np.array_equal(both, np.asarray(by_rows)) and not np.array_equal(
        both, np.asarray(by_cols)
    )
