"""The fused rotary + paged KV write (`rope_and_store_kv`), on the CPU through Triton's
interpreter: blocks of tokens per program (a prefix's launch) give the same bits as one token
per program (a decode step's), and both equal rotary and a paged write in PyTorch, with a
partial rotary width, keys copied out, and a token count that is not a multiple of the block."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.support.interpreted import interpreted_copy
from vlm_server.engine.device.kernels import triton_kv_store

HEADS, KVH, HD, HALF, PAGE = 3, 2, 32, 8, 4


@pytest.fixture(scope="module")
def ta() -> Iterator[ModuleType]:
    with interpreted_copy(triton_kv_store) as mod:
        yield mod


def _inputs(tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (HEADS + 2 * KVH) * HD, generator=g).bfloat16()
    angles = torch.rand(64, HALF, generator=g) * 6
    rows = torch.randint(0, 2, (tokens, 1), generator=g, dtype=torch.int32)
    positions = torch.randperm(32, generator=g)[:tokens].to(torch.int32)[:, None]
    table = torch.randperm(16, generator=g).to(torch.int32).view(2, 8)
    return {
        "qkv": qkv,
        "cos": angles.cos(),
        "sin": angles.sin(),
        "positions": positions,
        "block_table": table,
        "rows": rows,
    }


def _rotate(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary over the first 2 x HALF of each head [T, heads, HD], in fp32."""
    x = x.float()
    c, s = cos[pos][:, None], sin[pos][:, None]
    a, b = x[..., :HALF], x[..., HALF : 2 * HALF]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * HALF :]], -1)


def _run(ta: ModuleType, inp: dict, block: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ta, "ROPE_BLOCKS", ((1 << 62, block),))
    k_pool = torch.zeros(16, PAGE, KVH, HD, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    k_out = torch.zeros(inp["qkv"].shape[0], KVH, HD, dtype=torch.bfloat16)
    q = ta.rope_and_store_kv(**inp, k_pool=k_pool, v_pool=v_pool, n_heads=HEADS, k_out=k_out)
    return q, k_pool, v_pool, k_out


@pytest.mark.parametrize(("tokens", "block"), [(7, 4), (16, 16), (5, 8), (21, 16)])
def test_token_blocks_write_what_single_tokens_write(
    ta: ModuleType, tokens: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    inp = _inputs(tokens, tokens + block)
    one = _run(ta, inp, 1, monkeypatch)
    many = _run(ta, inp, block, monkeypatch)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)

    q, k_pool, v_pool, k_out = many
    pos = inp["positions"][:, 0].long()
    heads = inp["qkv"].view(tokens, HEADS + 2 * KVH, HD)
    torch.testing.assert_close(
        q.float(), _rotate(heads[:, :HEADS], pos, inp["cos"], inp["sin"]), atol=1e-2, rtol=1e-2
    )
    keys = _rotate(heads[:, HEADS : HEADS + KVH], pos, inp["cos"], inp["sin"])
    torch.testing.assert_close(k_out.float(), keys, atol=1e-2, rtol=1e-2)
    pages = inp["block_table"][inp["rows"][:, 0].long(), pos // PAGE].long()
    torch.testing.assert_close(k_pool[pages, pos % PAGE].float(), keys, atol=1e-2, rtol=1e-2)
    assert torch.equal(v_pool[pages, pos % PAGE], heads[:, HEADS + KVH :])
    written = torch.zeros(16, PAGE, dtype=torch.bool)
    written[pages, pos % PAGE] = True
    assert not k_pool[~written].any() and not v_pool[~written].any()


def test_the_block_grows_with_the_token_count() -> None:
    blocks = [triton_kv_store.rope_block(n) for n in (1, 15, 16, 127, 128, 730, 1 << 20)]
    assert blocks == [1, 1, 4, 4, 16, 16, 16]
