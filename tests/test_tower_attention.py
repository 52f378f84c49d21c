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


@pytest.mark.parametrize("fp8", [False, True])
def test_the_tower_with_the_kernel_equals_the_tower_with_sdpa(
    kern: ModuleType, monkeypatch: pytest.MonkeyPatch, fp8: bool
) -> None:
    """Both towers (16-bit and FP8 products) through the kernel, interpreted on the CPU."""
    from vlm_server.models.moondream2 import fp8_vision, vision
    from vlm_server.models.moondream2.config import VisionConfig

    torch.manual_seed(3)
    cfg = VisionConfig(
        enc_dim=96, enc_n_layers=2, enc_n_heads=4, enc_ff_dim=64, crop_size=56, patch_size=14,
        overlap_margin=1, proj_inner_dim=32, proj_out_dim=16,
    )  # fmt: skip
    enc = vision.VisionEncoder(cfg).eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.1)
    enc.use_fp8(fp8)
    crops = torch.randn(3, 3, 56, 56)
    with torch.inference_mode():
        want = enc.encode(crops)
        assert not enc.use_split_head_attention()  # the CPU: SDPA stays
        monkeypatch.setattr(vision, "tower_attention", kern)
        monkeypatch.setattr(fp8_vision, "tower_attention", kern)
        for block in enc.blocks:  # heads of 24: a 16-wide part and a padded rest
            block.attn.split_head = True
        got = enc.encode(crops)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_the_full_size_tower_with_the_kernel_stays_with_sdpa() -> None:
    """moondream2's tower at 9 crops in bf16, both towers: the kernel's features within bf16
    rounding of SDPA's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.support.towers import full_size_tower

    enc, crops = full_size_tower(seed=5)
    with torch.inference_mode():
        for fp8 in (False, True):
            enc.use_fp8(fp8)
            enc.use_split_head_attention(False)
            want = enc.encode(crops).float()
            assert enc.use_split_head_attention(True)
            got = enc.encode(crops).float()
            err = float((got - want).norm() / want.norm())
            assert err < 2e-2, (fp8, err)
