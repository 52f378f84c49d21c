"""The paged attention kernels (decode rows, and a mixed step's tiles) on the CPU through
Triton's interpreter, against the PyTorch paths: each split loops over its own live positions
only (a block table far wider than the contexts, splits past a short row's end, rows of one
position), in fp32."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import torch

from tests.support.interpreted import interpreted_copy
from vlm_server.engine.device.kernels import triton_attention
from vlm_server.engine.device.kernels.paged_attention import (
    paged_attention,
    ragged_paged_attention,
)

HEADS, KVH, HD, PAGE, N_PAGES, WIDTH = 4, 2, 16, 4, 90, 64  # the table: 256 positions a row


@pytest.fixture(scope="module")
def ta() -> Iterator[ModuleType]:
    with interpreted_copy(triton_attention) as mod:
        yield mod


def _pools(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kp = torch.randn(N_PAGES, PAGE, KVH, HD, generator=g)
    vp = torch.randn(N_PAGES, PAGE, KVH, HD, generator=g)
    table = torch.randint(1, N_PAGES, (6, WIDTH), generator=g, dtype=torch.int32)
    return kp, vp, table


@pytest.fixture(params=["static", "device-read"])
def loop(request: pytest.FixtureRequest, ta: ModuleType, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both loop forms: a compile-time bound with a branch per block, and the live blocks'."""
    if request.param == "device-read":
        monkeypatch.setattr(ta, "STATIC_LOOP_POSITIONS", 0)
    return request.param


def test_the_loop_form_follows_the_positions_a_split_covers() -> None:
    bound = triton_attention.static_loop_bound
    assert bound(2048, 16, 64) == 128 and bound(2048, 4, 64) == 512
    assert bound(2048, 1, 64) == 0 and bound(32768, 16, 64) == 0


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_decode_kernel_equals_pytorch(ta: ModuleType, loop: str, splits: int) -> None:
    kp, vp, table = _pools(splits)
    rows = torch.tensor([5, 0, 3, 3])
    lengths = torch.tensor([1, 9, 70, 131])  # 16 splits of 64: most splits of most rows empty
    q = torch.randn(4, HEADS, HD, generator=torch.Generator().manual_seed(7))
    got = ta.paged_decode_attention(q, kp, vp, table, rows, lengths, block_n=16, splits=splits)
    want = paged_attention(q[:, :, None], kp, vp, table[rows].long(), (lengths - 1)[:, None], 0)
    torch.testing.assert_close(got, want[:, :, 0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_tile_kernel_equals_pytorch_varlen(ta: ModuleType, loop: str, splits: int) -> None:
    from vlm_server.engine.core.mixed_inputs import MixedLayout
    from vlm_server.engine.core.step_plan import N_TOK, T_POS, T_ROW

    kp, vp, table = _pools(10 + splits)
    rows = [0, 1, 2] + [4] * 11 + [5] * 3  # three decode rows, two prompt chunks
    pos = [0, 40, 130, *range(60, 71), *range(2, 5)]
    t = len(rows)
    layout = MixedLayout(rows=6, max_tails=1)
    n = t + 3  # padding tokens
    tokens = np.zeros((t, N_TOK), np.int64)
    tokens[:, T_ROW], tokens[:, T_POS] = rows, pos
    host = layout.pack(np.zeros(layout.size(n), np.int64), tokens, np.zeros(0, np.int64), [], n, 5)
    dev = torch.from_numpy(host.copy())
    batch = dev[layout.tokens_at : layout.tiles_at(n)].view(n, N_TOK)
    tiles = dev[layout.tiles_at(n) :].view(-1, 2)
    q = torch.randn(n, HEADS, HD, generator=torch.Generator().manual_seed(3))
    got = ta.paged_tile_attention(
        q, kp, vp, table, batch[:, T_ROW], batch[:, T_POS], tiles, layout.tile_tokens, 16, splits
    )
    assert not got[t:].any()  # padding tokens
    want = ragged_paged_attention(q[:t], kp, vp, table, batch[:t, T_ROW], batch[:t, T_POS], WIDTH)
    torch.testing.assert_close(got[:t], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 8])
def test_a_mixed_steps_tokens_attend_one_by_one_as_decode_rows(
    ta: ModuleType, loop: str, splits: int
) -> None:
    """Small mixed steps skip the tiles (`per_token_attention`): each token, prompt tokens
    included, is a decode row of length position + 1, which is the causal varlen answer; pad
    tokens (the pad row at position 0) get finite values, so no buffer needs filling."""
    rows = [0, 1, 2] + [4] * 11 + [5] * 3 + [3] * 3  # decode rows, two prompts, pad tokens
    pos = [0, 40, 130, *range(60, 71), *range(2, 5), 0, 0, 0]
    kp, vp, table = _pools(20 + splits)
    rows_t, pos_t = torch.tensor(rows), torch.tensor(pos)
    q = torch.randn(len(rows), HEADS, HD, generator=torch.Generator().manual_seed(4))
    got = ta.paged_decode_attention(q, kp, vp, table, rows_t, pos_t + 1, block_n=16, splits=splits)
    want = ragged_paged_attention(q, kp, vp, table, rows_t, pos_t, WIDTH)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert triton_attention.per_token_attention(triton_attention.PER_TOKEN_MAX_TOKENS)
    assert not triton_attention.per_token_attention(triton_attention.PER_TOKEN_MAX_TOKENS + 1)
