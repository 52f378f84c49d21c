"""The host <-> device layout of one step's rows, shared by the scheduler and the runtimes.

Finalize input, one int64 row per sequence (temperature and top_p bit-cast from float64):
    row | mask row | phase | seed | sampled-token count | temperature | top_p
Output copied back per row (float32): token id | coordinate | width | height.
"""

from __future__ import annotations

import enum

F_ROW, F_MASK, F_PHASE, F_SEED, F_STEP, F_TEMP, F_TOP_P = range(7)
N_FIN = 7
O_TOKEN, O_COORD, O_WIDTH, O_HEIGHT = range(4)
N_OUT = 4


class RowPhase(enum.IntEnum):
    """What a row's step produces and which embedding becomes its next input."""

    TOKEN = 0  # sample a token; it is the next input
    BOUNDARY = 1  # sample a token (eos or not) and decode x; next input is x's embedding
    COORD = 2  # decode y; next input is its embedding
    SIZE = 3  # decode (w, h); next input is its embedding
    IDLE = 4  # zombie or finished row: outputs are ignored


REGION_PHASES = frozenset({RowPhase.BOUNDARY, RowPhase.COORD, RowPhase.SIZE})
