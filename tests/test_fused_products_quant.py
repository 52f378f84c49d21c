"""The fused decode products over 8- and 4-bit weights (models/common/quant_stack.py, the
skinny kernel's QBITS), on the CPU through Triton's interpreter: stacked stored values and
scales give, launch by launch and through a block's products, exactly what "dequantize, then
the 16-bit fused product" gives (the same tiles, the same sums: bit for bit); stacking keeps
every layer's output and moves its storage; what the stacks cannot take is refused.

The interpreter's tensor-core dot is wrong in bf16 and it truncates fp32 to bf16: tensor-core
launches run fp16 and fp32 here, bf16 only on the CUDA cores with power-of-two scales
(tests/test_quant_gemm.py says more). tests/test_fused_products_quant_gpu.py runs bf16 on a
GPU, and the tiny engine with quantized weights and fused decode."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.support import quant_reference as ref
from tests.support.interpreted import interpreted
from tests.support.quant_reference import block_outputs
from vlm_server.models.common import fused_products, quant_stack
from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.common.quant_stack import QuantWeight
from vlm_server.models.quant.formats import QuantFormat, weight_format

pytest.importorskip("triton")

INT8, INT4 = weight_format("int8"), weight_format("int4", 128)


@pytest.fixture(scope="module")
def kern() -> Iterator[SimpleNamespace]:
    from vlm_server.models.common import skinny_gemm

    mods = {"skinny_gemm": interpreted(skinny_gemm)}
    yield SimpleNamespace(**mods)
    for m in mods.values():
        del sys.modules[m.__name__]


def _parts(
    bits: int, shapes: list[tuple[int, int]], dtype: torch.dtype, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (qweight, scale) of each [n, k]: bf16 power-of-two scales for bf16, else fp16."""
    g = torch.Generator().manual_seed(seed)
    bf16 = dtype == torch.bfloat16
    scale_dtype = torch.bfloat16 if bf16 else torch.float16
    make = ref.random_int8 if bits == 8 else ref.random_int4
    return [make(n, k, g, scale_dtype, powers_of_two=bf16) for n, k in shapes]


CASES = [
    # rows, activations, stacked by columns (else rows), cuda cores, block_n, block_k, split,
    # epilogue: bias, residual, gelu
    (1, torch.bfloat16, True, True, 2, 64, 2, True, True, False),
    (1, torch.bfloat16, False, True, 4, 128, 1, True, False, True),
    (3, torch.float16, True, False, 16, 64, 3, True, True, False),
    (5, torch.float16, False, False, 16, 64, 1, True, False, True),
    (2, torch.float32, True, False, 8, 32, 1, False, True, False),
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_stacked_product_equals_the_dequantized_stack(
    kern: SimpleNamespace, bits: int, case: int
) -> None:
    rows, dtype, by_cols, fma, bn, bk, split, has_b, has_r, gelu = CASES[case]
    sg = kern.skinny_gemm
    g = torch.Generator().manual_seed(100 + case)
    if by_cols:  # proj [24, 128] beside fc2 [24, 256]: the branch over [attn | hidden]
        parts = _parts(bits, [(24, 128), (24, 256)], dtype, case)
        stacked = quant_stack.stack_cols(parts[0], parts[1])
        dense = torch.cat([ref.dequantize(q, s) for q, s in parts], 1).to(dtype)
        x1, x2 = (torch.randn(rows, k, generator=g).to(dtype) for k in (128, 256))
    else:  # qkv [16, 128] over fc1 [40, 128]
        parts = _parts(bits, [(16, 128), (40, 128)], dtype, case)
        stacked = quant_stack.stack_rows(parts)
        dense = torch.cat([ref.dequantize(q, s) for q, s in parts], 0).to(dtype)
        x1, x2 = torch.randn(rows, 128, generator=g).to(dtype), None
    n = dense.shape[0]
    assert stacked.shape == tuple(dense.shape)
    kw = {
        "x2": x2,
        "residual": torch.randn(rows, n, generator=g).to(dtype) if has_r else None,
        "gelu_from": 16 if gelu else None,
        "config": sg.SkinnyConfig(bn, bk, 4, 1, split, fma=fma),
    }
    b = torch.randn(n, generator=g).to(dtype) if has_b else None
    got = sg.skinny_linear(x1, stacked, b, **kw)
    want = sg.skinny_linear(x1, dense, b, **kw)
    assert got.dtype == dtype and torch.equal(got, want)
    # Split sums, no epilogue: the consumer (the next norm) finishes them.
    kw = {"x2": x2, "config": kw["config"]}
    sums = torch.empty(split, rows, n)
    got = sg.skinny_linear(x1, stacked, sums_out=sums, **kw)
    assert torch.equal(got, sg.skinny_linear(x1, dense, sums_out=torch.empty_like(sums), **kw))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_part_of_the_stack_is_that_layer(kern: SimpleNamespace, bits: int) -> None:
    """Column parts (proj's, fc2's share apart) and row parts (QKV alone, fc1 alone) read
    their own scales: each equals its layer's dequantized product."""
    sg = kern.skinny_gemm
    parts = _parts(bits, [(8, 128), (8, 256)], torch.float16, 7)
    stacked = quant_stack.stack_cols(parts[0], parts[1])
    x = torch.randn(2, 384, dtype=torch.float16)
    cfg = sg.SkinnyConfig(8, 64, 4, 1, 1)
    for (lo, hi), (q, s) in zip(((0, 128), (128, 384)), parts, strict=True):
        got = sg.skinny_linear(x[:, lo:hi], stacked.cols(lo, hi), config=cfg)
        want = sg.skinny_linear(x[:, lo:hi], ref.dequantize(q, s), config=cfg)
        assert torch.equal(got, want)
    rows = quant_stack.stack_rows(_parts(bits, [(8, 128), (24, 128)], torch.float16, 8))
    part = rows.rows(8, 32)
    assert torch.equal(part.qweight, rows.qweight[8:]) and part.shape == (24, 128)


def _linears(seed: int) -> tuple[nn.Linear, ...]:
    torch.manual_seed(seed)
    # qkv, fc1, proj, fc2 of a block of width 128 and hidden layer 256
    return nn.Linear(128, 48), nn.Linear(128, 256), nn.Linear(128, 128), nn.Linear(256, 128)


def _small_linears(seed: int) -> tuple[nn.Linear, ...]:
    torch.manual_seed(seed)
    # a narrower block for the interpreted block products: hidden layer 128
    return nn.Linear(128, 16), nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 128)


def _quantized(linear: nn.Linear, fmt: QuantFormat, dtype: torch.dtype) -> QuantLinear:
    layer = QuantLinear.like(linear, fmt)
    q, s = fmt.quantize("weight", linear.weight.detach())
    layer.load_state_dict({"qweight": q, "scale": s, "bias": linear.bias.detach()})
    return layer.to(dtype)


def _twin(layer: QuantLinear, dtype: torch.dtype) -> nn.Linear:
    """The 16-bit layer holding ``layer``'s dequantized weight."""
    plain = nn.Linear(layer.in_features, layer.out_features, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(layer.dequantized(dtype))
        assert layer.bias is not None
        plain.bias.copy_(layer.bias)
    return plain


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=["int8", "int4"])
def test_stacking_keeps_each_layer_and_moves_its_storage(fmt: QuantFormat) -> None:
    layers = [_quantized(m, fmt, torch.float32) for m in _linears(0)]
    x, h = torch.randn(3, 128), torch.randn(3, 256)
    before = [m(inp) for m, inp in zip(layers, (x, x, x, h), strict=True)]
    prod = fused_products.stack_block(*layers)
    after = [m(inp) for m, inp in zip(layers, (x, x, x, h), strict=True)]
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
    qkv, fc1, proj, fc2 = layers
    assert isinstance(prod.w_in, QuantWeight) and isinstance(prod.w_out, QuantWeight)
    assert not prod.takes_shrinks
    assert qkv.qweight.data_ptr() == prod.w_in.qweight.data_ptr()
    assert fc1.scale.data_ptr() == prod.w_in.rows(48, 304).scale.data_ptr()
    assert proj.qweight.data_ptr() == prod.w_out.qweight.data_ptr()
    assert fc2.qweight.data_ptr() == prod.w_out.cols(128, 384).qweight.data_ptr()
    assert prod.w_in.shape == (304, 128) and prod.w_out.shape == (128, 384)


def test_what_the_stacks_cannot_take_is_refused(kern: SimpleNamespace) -> None:
    mixed = [_quantized(m, INT8, torch.float32) for m in _linears(1)]
    mixed[3] = _linears(1)[3]
    assert not fused_products.stackable(*mixed)
    g32 = [_quantized(m, weight_format("int4", 32), torch.float32) for m in _linears(1)]
    assert not fused_products.stackable(*g32)
    with pytest.raises(ValueError, match="one format"):
        fused_products.stack_block(*mixed)
    prod = fused_products.stack_block(*[_quantized(m, INT8, torch.float32) for m in _linears(1)])
    with pytest.raises(ValueError, match="split at 128"):  # two scales: the input must split
        kern.skinny_gemm.skinny_linear(torch.randn(1, 384), prod.w_out)
    with pytest.raises(ValueError, match="one part"):
        prod.w_out.cols(0, 200)
    with pytest.raises(ValueError, match="16-bit weights only"):
        kern.skinny_gemm.skinny_linear_shrink(
            torch.randn(1, 128), prod.w_in, None, torch.randn(1, 4, 128)
        )
    with pytest.raises(ValueError, match="inputs of 64"):
        kern.skinny_gemm.skinny_linear(torch.randn(1, 64), prod.w_in)


def _add_partials_layernorm(
    x: torch.Tensor,
    parts: torch.Tensor,
    bias: torch.Tensor,
    norm: LayerNorm,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_norm's kernel in PyTorch (the interpreter's runs it wrong in bf16): the split
    sums in order, the bias, rounded once, added to x."""
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    assert extra is None  # no adapter here
    s = x + (acc + bias.float()).to(x.dtype).view_as(x)
    return s, norm(s)


@pytest.mark.parametrize(
    "fmt,rows,dtype",
    [
        pytest.param(INT8, 1, torch.bfloat16, marks=pytest.mark.slow),
        (INT4, 1, torch.bfloat16),
        pytest.param(INT8, 4, torch.float16, marks=pytest.mark.slow),
        pytest.param(INT4, 4, torch.float16, marks=pytest.mark.slow),
    ],
    ids=["int8-1", "int4-1", "int8-4", "int4-4"],
)
def test_a_blocks_products_equal_the_dequantized_blocks(
    kern: SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    fmt: QuantFormat,
    rows: int,
    dtype: torch.dtype,
) -> None:
    """Every product a decode step takes of a block (QKV with the GELU'd hidden layer, QKV
    alone, the forked MLP, the branch finished in the next norm or added), at the default
    launch shapes, bit for bit those of the 16-bit block holding the dequantized weights."""
    monkeypatch.setattr(fused_products, "skinny_gemm", kern.skinny_gemm)
    monkeypatch.setattr(fused_products, "add_partials_layernorm", _add_partials_layernorm)
    layers = [_quantized(m, fmt, dtype) for m in _small_linears(2)]
    for layer in layers:  # power-of-two bf16 scales: the interpreter's bf16 rounds exactly
        layer.scale = torch.exp2(torch.round(torch.log2(layer.scale.float()))).to(torch.bfloat16)
    twins = [_twin(m, dtype) for m in layers]
    quant, dense = fused_products.stack_block(*layers), fused_products.stack_block(*twins)
    g = torch.Generator().manual_seed(rows)
    h, x, attn = (torch.randn(rows, 128, generator=g).to(dtype) for _ in range(3))
    norm = LayerNorm(128).to(dtype)
    outs = [block_outputs(prod, h, x, attn, norm) for prod in (quant, dense)]
    for got, want in zip(*outs, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)
