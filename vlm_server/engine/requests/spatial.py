"""Spatial references in a prompt: points and boxes the model reads through its region encoders.

The reference encodes a point (x, y) as two coordinate positions and a box as three: its
centre x, centre y, then its size (x_max - x_min, y_max - y_min); they follow the task's prompt
prefix, in order. In the prompt each such position holds a placeholder id past the vocabulary,
``vocab_size + j`` for the request's j-th reference position; the engine writes the encodings of
the request's values into its row's slots before its prompt runs, and the prompt's embedding
takes slot j wherever it finds placeholder j.
"""

from __future__ import annotations

import numpy as np

COORD, SIZE = 0, 1  # the kind column of `ref_values`
# One reference position: kind | coordinate or width | height.
N_REF = 3


def positions(refs: tuple[tuple[float, ...], ...]) -> int:
    """Prompt positions the references take."""
    return sum(2 if len(r) == 2 else 3 for r in refs)


def placeholders(refs: tuple[tuple[float, ...], ...], vocab_size: int) -> list[int]:
    """The prompt ids of the references' positions."""
    return [vocab_size + j for j in range(positions(refs))]


def ref_values(refs: tuple[tuple[float, ...], ...]) -> np.ndarray:
    """[positions, N_REF] float64: what each position encodes, in the reference's arithmetic
    (Python floats; the model's encoders round them to its dtype)."""
    out = np.zeros((positions(refs), N_REF), np.float64)
    j = 0
    for ref in refs:
        if len(ref) == 2:
            out[j : j + 2, 0] = COORD
            out[j, 1], out[j + 1, 1] = ref
            j += 2
        else:
            x0, y0, x1, y1 = ref
            out[j : j + 2, 0] = COORD
            out[j, 1], out[j + 1, 1] = (x0 + x1) / 2, (y0 + y1) / 2
            out[j + 2] = (SIZE, x1 - x0, y1 - y0)
            j += 3
    return out
