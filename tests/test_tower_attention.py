"""The vision tower's Triton attention (`tower_attention`), on the CPU through Triton's
interpreter: against attention in float64 over head widths with and without a tail slice,
partial and whole key blocks, strided QKV rows; and the dispatch to SDPA off CUDA."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.support.interpreted import interpreted
from vlm_server.models.common import tower_attention as ta


@pytest.fixture(scope="module")
def mod() -> Iterator[ModuleType]:
    pytest.importorskip("triton")
    copy = interpreted(ta)
    yield copy
    del sys.modules[copy.__name__]


def _want(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    n, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = (c.double().view(n, t, heads, -1).transpose(1, 2) for c in qkv.chunk(3, -1))
    w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (w @ v).transpose(1, 2).reshape(n, t, d)


@pytest.mark.parametrize(
    ("head_dim", "want"),
    [(72, (64, 16)), (64, (64, 0)), (40, (32, 16)), (96, (64, 32)), (16, (16, 0))],
)
def test_a_head_splits_into_two_power_of_two_slices(head_dim: int, want: tuple[int, int]) -> None:
    assert ta.head_slices(head_dim) == want


CASES = [
    # crops, positions, heads, head_dim, block_m, block_n
    (2, 37, 2, 72, 16, 16),  # the tower's head width; a partial last block of queries and keys
    (1, 32, 3, 72, 16, 16),  # keys in whole blocks only
    (2, 9, 2, 72, 16, 16),  # fewer keys than one block
    (1, 50, 2, 64, 32, 16),  # no tail slice
    (3, 21, 1, 40, 16, 32),  # a tail of 8 in a 16-wide slice, one partial key block
]


# Triton 3.6's interpreter does not multiply bf16 tiles; fp16 takes the same code path
# (bf16 is checked on the GPU).
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_kernel_equals_attention(mod: ModuleType, case: int, dtype: torch.dtype) -> None:
    n, t, heads, hd, bm, bn = CASES[case]
    g = torch.Generator().manual_seed(case)
    qkv = (torch.randn(n, t, 3 * heads * hd, generator=g) * 1.5).to(dtype)
    cfg = mod.TowerAttentionConfig(block_m=bm, block_n=bn, warps=4, stages=1)
    got = mod.tower_attention_triton(qkv, heads, cfg)
    assert got.shape == (n, t, heads * hd) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.double(), _want(qkv, heads), atol=tol, rtol=tol)


def test_strided_rows_are_read_in_place(mod: ModuleType) -> None:
    """QKV rows inside a wider buffer (row stride above 3d) give the same attention."""
    n, t, heads, hd = 2, 19, 2, 72
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(n, t, 3 * heads * hd + 24, generator=g).to(torch.float16)
    qkv = wide[..., : 3 * heads * hd]
    assert not qkv.is_contiguous()
    cfg = mod.TowerAttentionConfig(block_m=16, block_n=16, warps=4, stages=1)
    got = mod.tower_attention_triton(qkv, heads, cfg)
    torch.testing.assert_close(got, mod.tower_attention_triton(qkv.contiguous(), heads, cfg))
    torch.testing.assert_close(got.double(), _want(qkv, heads), atol=5e-3, rtol=5e-3)


def test_a_bad_width_names_the_heads(mod: ModuleType) -> None:
    with pytest.raises(ValueError, match="3 x a multiple of 5 heads"):
        mod.tower_attention_triton(torch.zeros(1, 4, 3 * 72, dtype=torch.float16), 5)


def test_off_cuda_the_attention_is_sdpas() -> None:
    qkv = torch.randn(2, 11, 3 * 2 * 72)
    assert not ta.uses_triton(qkv)
    got = ta.tower_attention(qkv, 2)
    torch.testing.assert_close(got, ta.tower_attention_sdpa(qkv, 2))
    torch.testing.assert_close(got.double(), _want(qkv, 2), atol=1e-5, rtol=1e-5)


def test_the_sdpa_backend_is_chosen_inside_its_block() -> None:
    assert ta._backend == "triton"
    with ta.backend("sdpa"):
        assert ta._backend == "sdpa"
    assert ta._backend == "triton"
    with (
        pytest.raises(ValueError, match="tower attention backend must be one of"),
        ta.backend("cudnn"),
    ):
        pass
    assert ta._backend == "triton"
