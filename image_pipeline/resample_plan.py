"""Separable resampling as data: a resize is a list of per-axis integer stages.

Both resizers we replicate (libvips' ``resize`` and Pillow's LANCZOS ``resize``) work on
uint8 pixels in fixed point: each pass along one axis is a weighted sum with integer
weights, a rounding shift and (usually) a clip to 0..255. A stage here holds exactly
that, so the same plan runs in torch on any device (:mod:`.resample`) and gives the
same bits as the library it was built from.

Plans are pure data built on the CPU in float64, as the libraries build their tables;
they are cached per size pair by their builders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["COLS", "ROWS", "BoxShrink", "Filter", "Plan", "Stage"]

ROWS = 0  # the stage runs along the height
COLS = 1  # ... along the width


@dataclass(frozen=True, eq=False)
class Filter:
    """``out[o] = clip?(floor((sum_i weights[o, i] * in[i] + 2**(shift-1)) / 2**shift))``.

    Attributes:
        axis: :data:`ROWS` or :data:`COLS`.
        weights: int64 ``[out_len, in_len]``; mostly zero (a band around the diagonal).
        shift: fixed-point fraction bits of the weights.
        clip: clip to 0..255 (False for an intermediate kept at full range).
    """

    axis: int
    weights: np.ndarray
    shift: int
    clip: bool = True
    # First and one-past-last nonzero input index per output index.
    starts: np.ndarray = field(init=False, repr=False)
    stops: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        nonzero = self.weights != 0
        any_nz = nonzero.any(axis=1)
        starts = np.where(any_nz, nonzero.argmax(axis=1), 0)
        stops = np.where(any_nz, nonzero.shape[1] - nonzero[:, ::-1].argmax(axis=1), 0)
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "stops", stops)

    @property
    def in_len(self) -> int:
        return self.weights.shape[1]

    @property
    def out_len(self) -> int:
        return self.weights.shape[0]

    def out_bound(self, in_bound: int) -> int:
        """Largest magnitude of an output when inputs lie within ``[-in_bound, in_bound]``."""
        if self.clip:
            return 255
        total = int(np.abs(self.weights).sum(axis=1).max()) * in_bound
        bound = (total >> self.shift) + 1
        if bound >= 1 << 15:
            raise ValueError("an unclipped stage must stay within int16")
        return bound


@dataclass(frozen=True)
class BoxShrink:
    """libvips' integer box shrink (``shrinkv``/``shrinkh``, uint8 path of 8.17 and later).

    Groups of ``factor`` inputs (the last group padded by repeating the edge) are summed
    and divided by a multiply-shift: ``((sum + factor // 2) * (2**24 // factor)) >> 24``.
    """

    axis: int
    factor: int
    in_len: int

    @property
    def out_len(self) -> int:
        return -(-self.in_len // self.factor)

    @property
    def multiplier(self) -> int:
        return (1 << 32) // (256 * self.factor)


Stage = Filter | BoxShrink


@dataclass(frozen=True)
class Plan:
    """Stages in order, from an ``in_size`` to an ``out_size`` image (``(height, width)``)."""

    in_size: tuple[int, int]
    out_size: tuple[int, int]
    stages: tuple[Stage, ...]
