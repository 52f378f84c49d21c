"""The mixed step's input layout (core/mixed_inputs.py), the runtime's graph keys and the
prefill path's SM carveout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.mixed_inputs import MixedLayout
from vlm_server.engine.core.step_plan import N_TOK, T_ID, T_POS, T_ROW
from vlm_server.engine.device.graphs import image_tilings, sm_carveout, token_buckets

LAYOUT = MixedLayout(rows=9, max_tails=4)


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(0, 20),
    pad=st.integers(0, 10),
    n_last=st.integers(0, 9),
    n_tails=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_pack_round_trips_and_pads(t: int, pad: int, n_last: int, n_tails: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(-1, 500, (t, N_TOK))
    # Rows in runs, as a step lays them out: decode rows (runs of one), then prompt chunks.
    runs = rng.integers(1, 40, t)
    tokens[:, T_ROW] = np.repeat(np.arange(t), runs)[:t] if t else 0
    last = rng.integers(-1, max(t, 1), n_last)
    tails = [tuple(int(x) for x in rng.integers(1, 99, 2)) for _ in range(n_tails)]
    # Scratch full of garbage: everything the layout promises must be written by pack.
    scratch = rng.integers(-(2**40), 2**40, LAYOUT.size(40))
    n = t + pad
    out = LAYOUT.pack(scratch, tokens, last, tails, n, pad_row=8)
    assert len(out) == LAYOUT.size(n) and np.shares_memory(out, scratch)
    assert out[:n_last].tolist() == last.tolist() and not out[n_last : LAYOUT.rows].any()
    pairs = out[LAYOUT.tails_at : LAYOUT.tokens_at].reshape(-1, 2)[:n_tails]
    assert [tuple(p) for p in pairs.tolist()] == tails
    batch = out[LAYOUT.tokens_at : LAYOUT.tiles_at(n)].reshape(n, N_TOK)
    assert (batch[:t] == tokens).all()
    # Pad tokens: the pad row (its pages are the sink) at position 0, a real token id.
    assert (batch[t:, T_ROW] == 8).all() and not batch[t:, T_POS].any()
    assert not batch[t:, T_ID].any()
    # Tiles: consecutive tokens of one row each, at most tile_tokens, covering [0, t) in order.
    tiles = out[LAYOUT.tiles_at(n) :].reshape(-1, 2)
    assert len(tiles) == LAYOUT.max_tiles(n)
    used = tiles[tiles[:, 1] > 0]
    assert not tiles[len(used) :].any()
    assert (used[:, 1] <= LAYOUT.tile_tokens).all()
    ends = used[:, 0] + used[:, 1]
    if t:
        assert used[:, 0].tolist() == [0, *ends[:-1].tolist()] and ends[-1] == t
    else:
        assert not len(used)
    for first, count in used:
        assert len(set(tokens[first : first + count, T_ROW].tolist())) == 1
        assert (
            first + count == t
            or count == LAYOUT.tile_tokens
            or (tokens[first + count, T_ROW] != tokens[first, T_ROW])
        )


def test_pack_refuses_what_does_not_fit() -> None:
    scratch = np.zeros(LAYOUT.size(8), np.int64)
    empty = np.zeros((0, N_TOK), np.int64)
    none = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="do not fit"):
        LAYOUT.pack(scratch, np.zeros((9, N_TOK), np.int64), none, [], 8, 0)
    with pytest.raises(ValueError, match="tail copies"):
        LAYOUT.pack(scratch, empty, none, [(1, 2)] * 5, 8, 0)
    with pytest.raises(ValueError, match="step rows"):
        LAYOUT.pack(scratch, empty, np.zeros(10, np.int64), [], 8, 0)


@pytest.mark.parametrize("budget", [65, 100, 512, 4096, 5000])
def test_token_buckets_cover_the_budget_with_bounded_padding(budget: int) -> None:
    sizes = token_buckets(budget)
    assert sizes == sorted(set(sizes)) and sizes[-1] == budget and sizes[0] >= 1
    for t in range(1, budget + 1):
        bucket = next(s for s in sizes if s >= t)
        # At most half a step of padding beyond the smallest bucket.
        assert t <= 16 or bucket <= 1.5 * t + 1, (t, bucket)


def test_image_tilings_are_every_grid_within_the_crop_budget() -> None:
    tilings = image_tilings(12)
    assert len(tilings) == len(set(tilings)) == sum(12 // h for h in range(1, 13))
    assert all(h * w <= 12 for h, w in tilings)
    crops = [h * w for h, w in tilings]
    assert crops == sorted(crops, reverse=True)  # largest first: one shared graph pool


def test_sm_carveout_applies_inside_and_restores_after() -> None:
    before = torch._C._get_sm_carveout_experimental()
    with sm_carveout(24):
        assert torch._C._get_sm_carveout_experimental() == 24
    assert torch._C._get_sm_carveout_experimental() == before
    with sm_carveout(0):  # no carveout: the setting is left alone
        assert torch._C._get_sm_carveout_experimental() == before
    with pytest.raises(ValueError, match="prefill_sm_carveout"):
        EngineConfig(prefill_sm_carveout=-1)
