"""The vision tower's attention kernel (models/common/tower_attention.py) in Triton's
interpreter on the CPU against `F.scaled_dot_product_attention`: heads split into a power-of-two
part and a padded rest (72 = 64 + 8), whole heads, token counts that fill no block, strided
rows; and on the GPU at the tower's size in bf16."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import interpreted_copy
from vlm_server.models.common import tower_attention

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kern() -> Iterator[ModuleType]:
    with interpreted_copy(tower_attention) as mod:
        yield mod


def _sdpa(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    n, t, three_d = qkv.shape
    d = three_d // 3
    q, k, v = (c.view(n, t, heads, d // heads).transpose(1, 2) for c in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)


def test_a_head_splits_into_a_power_of_two_and_a_padded_rest() -> None:
    from vlm_server.models.common.tower_attention import split_head

    assert split_head(72) == (64, 16)
    assert split_head(64) == (64, 0)
    assert split_head(40) == (32, 16)
    assert split_head(100) == (64, 64)
    with pytest.raises(ValueError, match="head width"):
        split_head(8)


@pytest.mark.parametrize(
    ("heads", "hd", "n", "t"), [(2, 72, 2, 37), (3, 64, 1, 50), (2, 40, 3, 17)]
)
def test_attention_equals_sdpa_in_fp32(
    kern: ModuleType, monkeypatch: pytest.MonkeyPatch, heads: int, hd: int, n: int, t: int
) -> None:
    monkeypatch.setattr(kern, "BLOCK_M", 16)  # several query and key blocks, the last partial
    monkeypatch.setattr(kern, "BLOCK_N", 16)
    gen = torch.Generator().manual_seed(heads * hd + t)
    qkv = torch.randn(n, t, 3 * heads * hd, generator=gen) * 2
    got = kern.attention(qkv, heads)
    assert got.shape == (n, t, heads * hd)
    torch.testing.assert_close(got, _sdpa(qkv, heads), rtol=1e-5, atol=1e-5)


def test_attention_reads_strided_rows(kern: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kern, "BLOCK_M", 16)
    monkeypatch.setattr(kern, "BLOCK_N", 16)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 21, 3 * 2 * 72 + 8, generator=gen)
    qkv = wide[..., : 3 * 2 * 72]  # rows 440 apart, not 432
    torch.testing.assert_close(kern.attention(qkv, 2), _sdpa(qkv, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_attention_on_the_gpu_at_the_towers_size() -> None:
    """9 crops of 729 patches, 16 heads of 72, bf16: within bf16 rounding of SDPA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vlm_server.models.common.tower_attention import attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(9, 729, 3 * 1152, device="cuda", generator=gen).bfloat16()
    got = attention(qkv, 16).float()
    want = _sdpa(qkv.float(), 16)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-2, err
