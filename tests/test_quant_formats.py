"""The INT8 and INT4 weight formats (docs/quantization.md): round trips within half a scale,
values on the grid exact, the packing bit for bit, and refusals naming the tensor."""

from __future__ import annotations

import pytest
import torch

from vlm_server.models.quant.formats import (
    QuantError,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    weight_format,
)


def _weights(*shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)


def test_int8_round_trip_within_half_a_scale() -> None:
    w = _weights(3, 16, 256)  # a stack of experts: leading dimensions kept
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.bfloat16 and scale.shape == (3, 16)
    err = (dequantize_int8(q, scale, torch.float32) - w.float()).abs()
    assert (err <= scale.float()[..., None] / 2 + 1e-7).all()
    assert q.abs().max() == 127  # each row's maximum lands on the end of the grid


def test_int4_round_trip_within_half_a_scale() -> None:
    w = _weights(16, 256)
    q, scale = quantize_int4(w, 128)
    assert q.dtype == torch.uint8 and q.shape == (16, 128)
    assert scale.dtype == torch.bfloat16 and scale.shape == (16, 2)
    back = dequantize_int4(q, scale, 128, torch.float32)
    bound = scale.float().repeat_interleave(128, dim=-1) / 2
    assert ((back - w.float()).abs() <= bound + 1e-7).all()


def test_values_on_the_grid_come_back_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    steps = torch.tensor([0.5, 0.25, 0.125, 2.0]).repeat_interleave(64)[None]  # [1, 256]
    grid4 = torch.randint(-7, 8, (4, 256), generator=gen)
    grid4[:, ::32] = 7  # every group of 32 reaches its maximum: the scale is the step
    w4 = grid4 * steps
    q, s = quantize_int4(w4, 32)
    assert torch.equal(dequantize_int4(q, s, 32, torch.float32), w4)
    grid8 = torch.randint(-127, 128, (4, 256), generator=gen)
    grid8[:, 0] = 127
    w8 = grid8 * 0.0625
    q8, s8 = quantize_int8(w8)
    assert torch.equal(q8.long(), grid8) and torch.equal(dequantize_int8(q8, s8, torch.float32), w8)


def test_zero_rows_get_scale_one_and_zero_values() -> None:
    w = torch.zeros(2, 128)
    w[1, 5] = 0.7
    q, s = quantize_int8(w)
    assert s[0] == 1 and not q[0].any()
    q4, s4 = quantize_int4(w, 128)
    assert s4[0, 0] == 1 and not q4[0].any()


def test_packing_layout_bit_for_bit() -> None:
    # Columns 0..3 hold 1, -1, -8, 7: the even column in the low nibble, two's complement.
    q = torch.tensor([[1, -1, -8, 7]])
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0xF1, 0x78]]
    assert torch.equal(unpack_int4(packed), q.to(torch.int8))
    every = torch.arange(-8, 8).repeat(2)[None]
    assert torch.equal(unpack_int4(pack_int4(every)), every.to(torch.int8))


def test_int4_refuses_columns_off_the_group_naming_the_tensor() -> None:
    fmt = weight_format("int4")
    with pytest.raises(QuantError, match=r"vision\.blocks\.0\.mlp\.fc2\.weight.*4304"):
        fmt.quantize("vision.blocks.0.mlp.fc2.weight", torch.zeros(8, 4304))
    with pytest.raises(QuantError, match=r"text\.x\.weight: shape \[64\] is not a weight"):
        weight_format("int8").quantize("text.x.weight", torch.zeros(64))
    with pytest.raises(QuantError, match="even number"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))


def test_format_descriptions() -> None:
    int8, int4 = weight_format("int8"), weight_format("int4")
    assert (int8.bits, int8.group_size, int4.bits, int4.group_size) == (8, 0, 4, 128)
    assert int8.bytes_per_param(2048) == 1 + 2 / 2048
    assert int4.bytes_per_param(2048) == 0.5 + 2 / 128
    assert int4.scale_shape("w", (8, 16, 256)) == (8, 16, 2)
    assert int4.qweight_shape("w", (16, 256)) == (16, 128)
    assert int8.scale_shape("w", (16, 256)) == (16,)
    with pytest.raises(QuantError, match="group_size: 100"):
        weight_format("int4", 100)
    with pytest.raises(QuantError, match="weights: 'int3'"):
        weight_format("int3")
