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
    # Sample a token and decode x; the next input is x's embedding if the token is the
    # coordinate token, else the token's (grounded reasoning).
    REASON = 2
    COORD = 3  # decode y; next input is its embedding
    SIZE = 4  # decode (w, h); next input is its embedding
    IDLE = 5  # zombie or finished row: outputs are ignored


# Phases that sample a token (the lowest values: compared with <=).
SAMPLING_PHASES = frozenset({RowPhase.TOKEN, RowPhase.BOUNDARY, RowPhase.REASON})
REGION_PHASES = frozenset({RowPhase.BOUNDARY, RowPhase.REASON, RowPhase.COORD, RowPhase.SIZE})
