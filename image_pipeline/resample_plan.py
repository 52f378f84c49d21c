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

from dataclasses import dataclass

import numpy as np

__all__ = ["COLS", "ROWS", "BoxShrink", "Filter", "Plan", "Stage"]

ROWS = 0  # the stage runs along the height
COLS = 1  # ... along the width


@dataclass(frozen=True, eq=False)
class Filter:
    """``out[o] = clip?(floor((sum_i w[o, i] * in[i] + 2**(shift-1)) / 2**shift))``.

    The weight matrix ``w`` is banded; it is stored as one row of taps per output:
    ``w[o, starts[o] + k] = band[o, k]`` for ``k < stops[o] - starts[o]``, zero elsewhere.

    Attributes:
        axis: :data:`ROWS` or :data:`COLS`.
        in_len: input length along ``axis``.
        starts, stops: int64 ``[out_len]``, the input span of each output.
        band: int64 ``[out_len, width]``, the taps (zero-padded on the right).
        shift: fixed-point fraction bits of the weights.
        clip: clip to 0..255 (False for an intermediate kept at full range).
    """

    axis: int
    in_len: int
    starts: np.ndarray
    stops: np.ndarray
    band: np.ndarray
    shift: int
    clip: bool = True

    @classmethod
    def from_rows(
        cls, axis: int, in_len: int, rows: list[dict[int, int]], shift: int, clip: bool = True
    ) -> Filter:
        """Build from one ``{input index: weight}`` map per output."""
        starts = np.array([min(r) if r else 0 for r in rows], dtype=np.int64)
        stops = np.array([max(r) + 1 if r else 0 for r in rows], dtype=np.int64)
        width = max(int((stops - starts).max()), 1) if rows else 1
        band = np.zeros((len(rows), width), dtype=np.int64)
        for o, row in enumerate(rows):
            for i, w in row.items():
                band[o, i - starts[o]] += w
        return cls(axis, in_len, starts, stops, band, shift, clip)

    @property
    def out_len(self) -> int:
        return self.band.shape[0]

    def dense(self, out_start: int, out_stop: int, in_start: int, in_stop: int) -> np.ndarray:
        """Rows ``out_start:out_stop``, columns ``in_start:in_stop`` of the weight matrix."""
        block = np.zeros((out_stop - out_start, in_stop - in_start), dtype=np.int64)
        for r, o in enumerate(range(out_start, out_stop)):
            s, e = int(self.starts[o]), int(self.stops[o])
            block[r, s - in_start : e - in_start] = self.band[o, : e - s]
        return block

    def out_bound(self, in_bound: int) -> int:
        """Largest magnitude of an output when inputs lie within ``[-in_bound, in_bound]``."""
        if self.clip:
            return 255
        total = int(np.abs(self.band).sum(axis=1).max()) * in_bound
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
