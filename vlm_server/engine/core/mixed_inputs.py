"""Where a mixed step's inputs sit in its slot's flat int64 device buffer (CUDA-free).

One host-to-device copy per step carries everything the step's device work reads:

    last     [rows]             index in the token batch of each step row's last token
    tails    [max_tails, 2]     (source, destination) page of each prefix tail copy
    tokens   [n_tokens, N_TOK]  row | position | id of each token (core/step_plan.py)
    tiles    [max_tiles, 2]     (first token, count) of each attention tile: up to
                                ``tile_tokens`` consecutive tokens of one row (a decode row
                                is a tile of one), padded with empty tiles

The fixed-size parts come first, so a CUDA graph captured for one token count reads them at
the same addresses every step; the token batch is padded to that count with pad tokens (the
pad row at position 0, whose block-table row points at the sink page), and ``last`` with 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlm_server.engine.core.step_plan import N_TOK, T_ROW


@dataclass(frozen=True)
class MixedLayout:
    rows: int  # entries of ``last``: every block-table row, plus the pad row
    max_tails: int
    tile_tokens: int = 16

    @property
    def tails_at(self) -> int:
        return self.rows

    @property
    def tokens_at(self) -> int:
        return self.tails_at + 2 * self.max_tails

    def tiles_at(self, n_tokens: int) -> int:
        return self.tokens_at + N_TOK * n_tokens

    def max_tiles(self, n_tokens: int) -> int:
        """Tiles a step of ``n_tokens`` can need: a run of one row's tokens takes at most one
        tile more than its share of full tiles, and a step holds at most ``rows`` runs."""
        return min(n_tokens, self.rows + -(-n_tokens // self.tile_tokens))

    def size(self, n_tokens: int) -> int:
        """Buffer entries used by a step of ``n_tokens`` (padded) tokens."""
        return self.tiles_at(n_tokens) + 2 * self.max_tiles(n_tokens)

    def pack(
        self,
        out: np.ndarray,
        tokens: np.ndarray,
        last: np.ndarray,
        tails: Sequence[tuple[int, int]],
        n_tokens: int,
        pad_row: int,
    ) -> np.ndarray:
        """Write one step's inputs into ``out`` (reused host scratch) and return the used
        view; ``tokens`` is padded to ``n_tokens`` with pad tokens."""
        t = len(tokens)
        if t > n_tokens:
            raise ValueError(f"{t} tokens do not fit a batch of {n_tokens}")
        if len(last) > self.rows or len(tails) > self.max_tails:
            raise ValueError("more step rows or tail copies than the layout holds")
        used = out[: self.size(n_tokens)]
        used[: self.rows] = 0
        used[: len(last)] = last
        pairs = used[self.tails_at : self.tokens_at].reshape(self.max_tails, 2)
        if tails:
            pairs[: len(tails)] = tails
        batch = used[self.tokens_at : self.tiles_at(n_tokens)].reshape(n_tokens, N_TOK)
        batch[:t] = tokens
        batch[t:] = 0
        batch[t:, T_ROW] = pad_row
        tiles = used[self.tiles_at(n_tokens) :].reshape(-1, 2)
        tiles[:] = 0
        if t:
            rows = tokens[:, T_ROW]
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            lengths = np.diff(np.r_[starts, t])
            per_run = -(-lengths // self.tile_tokens)
            first = np.cumsum(per_run) - per_run  # each run's first tile
            k = np.arange(per_run.sum()) - np.repeat(first, per_run)
            begin = np.repeat(starts, per_run) + k * self.tile_tokens
            tiles[: len(begin), 0] = begin
            tiles[: len(begin), 1] = np.minimum(
                self.tile_tokens, np.repeat(starts + lengths, per_run) - begin
            )
        return used
