"""Compact KV pages (``--kv-dtype int8|fp8``): the quantization rule (models/kv.py), its error
and scale granularity, the Triton store and attention kernels on the CPU through Triton's
interpreter against dequantize-then-attend in PyTorch, and the pool's pages and scales."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.support.interpreted import interpreted_copy
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.device.kernels import triton_attention, triton_kv_store
from vlm_server.engine.device.kernels.paged_attention import (
    paged_attention,
    ragged_paged_attention,
)
from vlm_server.models.kv import KV_QMAX, dequantize_kv, quantize_kv

COMPACT = [torch.int8, torch.float8_e4m3fn]
# Relative error bound of one element against its vector's largest magnitude: half an INT8
# step (0.5 / 127), or half an e4m3 ulp in the top binade ([256, 448]: ulp 32, so 16 / 448).
ELEMENT_BOUND = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 16 / 448}
HEADS, KVH, HD, PAGE, N_PAGES, WIDTH = 4, 2, 16, 4, 40, 16


def _vectors(seed: int, *shape: int) -> torch.Tensor:
    """N(0, 1) vectors whose magnitudes vary 4x between positions, as keys' do."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(
        2 * torch.rand(*shape[:-1], 1, generator=g)
    )


@pytest.mark.parametrize("dtype", COMPACT)
def test_a_round_trip_is_within_the_formats_step(dtype: torch.dtype) -> None:
    x = _vectors(0, 64, 4, 32)
    x[3, 1] = 0  # an all-zero vector: scale 1, zeros back
    q, scale = quantize_kv(x, dtype)
    assert q.dtype == dtype and scale.shape == x.shape[:-1] and scale[3, 1] == 1
    back = dequantize_kv(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= ELEMENT_BOUND[dtype] * amax + 1e-7).all()
    # Each vector's largest element lands on the type's largest value: no range is wasted.
    assert torch.allclose(q.float().abs().amax(-1)[amax[..., 0] > 0], torch.tensor(KV_QMAX[dtype]))


def test_the_scale_granularity_measured() -> None:
    """The numbers models/kv.py quotes for one scale per (position, head) against one per
    (page, head) chosen with hindsight (the page's largest magnitude over all its positions)."""
    x = _vectors(0, 256, 16, 4, 64)  # [pages, page_size, kv heads, head_dim]
    found = {}
    for dtype in COMPACT:
        qmax = KV_QMAX[dtype]
        q, s = quantize_kv(x, dtype)
        per_position = (dequantize_kv(q, s, torch.float32) - x).norm() / x.norm()
        page_scale = x.abs().amax(dim=(1, 3), keepdim=True) / qmax
        y = (x / page_scale).clamp(-qmax, qmax)
        y = y.round() if dtype == torch.int8 else y.to(dtype).float()
        per_page = (y * page_scale - x).norm() / x.norm()
        found[dtype] = (round(per_position.item(), 4), round(per_page.item(), 4))
    assert found[torch.int8] == (0.0059, 0.0103)
    assert found[torch.float8_e4m3fn] == (0.025, 0.0262)


@pytest.fixture(scope="module")
def store() -> Iterator[ModuleType]:
    with interpreted_copy(triton_kv_store) as mod:
        yield mod


@pytest.fixture(scope="module")
def attention() -> Iterator[ModuleType]:
    with interpreted_copy(triton_attention) as mod:
        yield mod


def _compact_pools(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Pools [pages, page, kvh, hd] of quantized random keys and values, their scales, and a
    block table of 6 rows."""
    k, ks = quantize_kv(_vectors(seed, N_PAGES, PAGE, KVH, HD), dtype)
    v, vs = quantize_kv(_vectors(seed + 1, N_PAGES, PAGE, KVH, HD), dtype)
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(1, N_PAGES, (6, WIDTH), generator=g, dtype=torch.int32)
    return k, v, ks, vs, table


@pytest.mark.parametrize("dtype", COMPACT)
@pytest.mark.parametrize("block", [1, 4])
def test_the_store_kernel_writes_what_quantize_kv_gives(
    store: ModuleType, dtype: torch.dtype, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rotary off (HALF 0 would leave no rotary; a zero angle rotates by nothing): the stored
    keys and values are `quantize_kv` of the projection's, elements equal up to one step
    where a division's last bit differs, scales to fp32 rounding; ``k_out`` and ``v_out``
    hold the dequantized values."""
    monkeypatch.setattr(store, "ROPE_BLOCKS", ((1 << 62, block),))
    tokens, half = 7, 4
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (HEADS + 2 * KVH) * HD, generator=g)
    cos, sin = torch.ones(WIDTH * PAGE, half), torch.zeros(WIDTH * PAGE, half)
    pos = torch.randperm(WIDTH * PAGE, generator=g)[:tokens].to(torch.int32)[:, None]
    rows = torch.zeros(tokens, 1, dtype=torch.int32)
    table = torch.randperm(N_PAGES, generator=g)[:WIDTH].to(torch.int32)[None]
    kp = torch.zeros(N_PAGES, PAGE, KVH, HD, dtype=dtype)
    vp, ks, vs = (
        torch.zeros_like(kp),
        torch.zeros(N_PAGES, PAGE, KVH),
        torch.zeros(N_PAGES, PAGE, KVH),
    )
    k_out, v_out = torch.zeros(tokens, KVH, HD), torch.zeros(tokens, KVH, HD)
    store.rope_and_store_kv(
        qkv, cos, sin, pos, table, rows, kp, vp, HEADS, k_out=k_out, v_out=v_out,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    pages, offsets = table[0, pos[:, 0] // PAGE].long(), pos[:, 0] % PAGE
    heads = qkv.view(tokens, HEADS + 2 * KVH, HD)
    for got, scales, out, x in (
        (kp, ks, k_out, heads[:, HEADS : HEADS + KVH]),
        (vp, vs, v_out, heads[:, HEADS + KVH :]),
    ):
        want_q, want_s = quantize_kv(x, dtype)
        torch.testing.assert_close(scales[pages, offsets], want_s, rtol=1e-6, atol=0)
        steps = (got[pages, offsets].float() - want_q.float()).abs()
        assert (steps <= (1 if dtype == torch.int8 else 32)).all()  # one grid step at most
        assert (steps == 0).float().mean() > 0.99
        held = dequantize_kv(got[pages, offsets], scales[pages, offsets], torch.float32)
        torch.testing.assert_close(out, held)


@pytest.mark.parametrize("dtype", COMPACT)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_over_compact_pages_equals_dequantize_then_attend(
    attention: ModuleType, dtype: torch.dtype, splits: int
) -> None:
    """fp32 queries over the same stored values: the kernel folds the scales into the dot
    products and softmax weights, the reference dequantizes first; both sum in fp32, so they
    agree to fp32 rounding (2e-5), far below the format's own error."""
    kp, vp, ks, vs, table = _compact_pools(dtype, splits)
    rows = torch.tensor([5, 0, 3, 3])
    lengths = torch.tensor([1, 9, 40, 64])
    q = torch.randn(4, HEADS, HD, generator=torch.Generator().manual_seed(7))
    got = attention.paged_decode_attention(
        q, kp, vp, table, rows, lengths, block_n=16, splits=splits, k_scale=ks, v_scale=vs
    )
    pos = (lengths - 1)[:, None]
    want = paged_attention(q[:, :, None], kp, vp, table[rows].long(), pos, 0, ks, vs)
    torch.testing.assert_close(got, want[:, :, 0], atol=2e-5, rtol=2e-5)
    exact = dequantize_kv(kp, ks, torch.float32), dequantize_kv(vp, vs, torch.float32)
    plain = paged_attention(q[:, :, None], *exact, table[rows].long(), pos, 0)
    torch.testing.assert_close(want, plain)  # the PyTorch path is dequantize-then-attend


@pytest.mark.parametrize("dtype", COMPACT)
def test_tile_kernel_over_compact_pages_equals_dequantize_then_attend(
    attention: ModuleType, dtype: torch.dtype
) -> None:
    kp, vp, ks, vs, table = _compact_pools(dtype, 11)
    rows = torch.tensor([0, 1] + [4] * 7)  # two decode rows, a prompt chunk
    pos = torch.tensor([0, 40, *range(20, 27)])
    tiles = torch.tensor([[0, 1], [1, 1], [2, 7], [0, 0]], dtype=torch.int32)
    q = torch.randn(len(rows), HEADS, HD, generator=torch.Generator().manual_seed(3))
    got = attention.paged_tile_attention(
        q, kp, vp, table, rows, pos, tiles, 8, 16, 2, k_scale=ks, v_scale=vs
    )
    want = ragged_paged_attention(q, kp, vp, table, rows, pos, WIDTH, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_compact_pool_without_scales_is_refused(attention: ModuleType) -> None:
    kp, vp, _, _, table = _compact_pools(torch.int8, 0)
    q = torch.zeros(1, HEADS, HD)
    with pytest.raises(ValueError, match="scales"):
        attention.paged_decode_attention(q, kp, vp, table, torch.tensor([0]), torch.tensor([3]))


def test_kv_dtype_is_checked_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^kv_dtype must be one of auto, bf16, fp8, int8"):
        EngineConfig(kv_dtype="fp4")


def test_fp8_pages_are_refused_on_a_chip_without_fp8_naming_the_flag() -> None:
    from vlm_server.chip_features import Chip, ChipFeatureError, check

    ampere = Chip("A100", (8, 0), 12040, True, 108)
    with pytest.raises(ChipFeatureError, match=r"^--kv-dtype fp8 needs FP8"):
        check(False, 0, ampere, "fp8")
    check(False, 0, ampere, "int8")
    check(False, 0, Chip("H100", (9, 0), 12040, True, 132), "fp8")
    check(False, 0, None, "fp8")  # the CPU path converts in PyTorch


def test_a_family_without_compact_pages_refuses_them_in_one_line() -> None:
    from types import SimpleNamespace

    from vlm_server.models.capabilities import CapabilityError, check
    from vlm_server.models.interface import Capabilities, Formats

    formats = Formats(weights=("bf16",), kv=("bf16",))
    model = SimpleNamespace(
        capabilities=Capabilities(formats=formats), config=SimpleNamespace(name="toy")
    )
    with pytest.raises(
        CapabilityError, match=r"^--kv-dtype fp8: the model 'toy' takes KV pages in bf16 only$"
    ):
        check(model, {"kv_dtype": "fp8"})  # type: ignore[arg-type]
    check(model, {"kv_dtype": "auto"})  # type: ignore[arg-type]
