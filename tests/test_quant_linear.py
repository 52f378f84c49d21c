"""The quantized linear layer (models/common/quant_linear.py) off CUDA: each product equals a
16-bit layer's holding the dequantized weight (the kernels' numerics contract: every weight
rounded once to the scale's dtype, then to the activations'), its state is the stored values
and scales only, the module swap refuses what is not a linear layer; and its CUDA path (the
kernels, run by Triton's interpreter) takes each launch with its epilogue."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support import quant_reference as ref
from tests.support.interpreted import interpreted_copy
from vlm_server.models.common import quant_gemm, quant_linear
from vlm_server.models.common.layers import MLP
from vlm_server.models.common.quant_linear import QuantLinear, module_names, swap_linears
from vlm_server.models.quant.formats import QuantFormat, weight_format

FORMATS = [weight_format("int8"), weight_format("int4", 32), weight_format("int4", 128)]
IDS = ["int8", "int4-g32", "int4-g128"]


def _quantized(linear: nn.Linear, fmt: QuantFormat) -> QuantLinear:
    layer = QuantLinear.like(linear, fmt)
    q, s = fmt.quantize("weight", linear.weight.detach())
    layer.load_state_dict({"qweight": q, "scale": s, "bias": linear.bias.detach()})
    return layer


def _plain(layer: QuantLinear, dtype: torch.dtype) -> nn.Linear:
    """The 16-bit layer holding ``layer``'s dequantized weight."""
    plain = nn.Linear(layer.in_features, layer.out_features, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(layer.fmt.dequantize(layer.qweight, layer.scale).to(dtype))
        assert layer.bias is not None
        plain.bias.copy_(layer.bias)
    return plain


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_equals_the_dequantized_layer(fmt: QuantFormat, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    layer = _quantized(linear, fmt).to(dtype)
    assert layer.scale.dtype == torch.bfloat16  # scales keep the format's dtype
    plain = _plain(layer, dtype)
    for rows in (1, 5, 70):
        x = torch.randn(2, rows, 256, dtype=dtype)
        assert torch.equal(layer(x), plain(x))
        want = F.gelu(plain(x), approximate="tanh")
        assert torch.equal(layer(x, gelu=True), want)
    # The quantized weight is not the original: the format rounded it, within half a step.
    w = fmt.dequantize(layer.qweight, layer.scale, torch.float32)
    assert not torch.equal(w, linear.weight.detach())
    step = layer.scale.float()
    step = step[:, None] if fmt.group_size == 0 else step.repeat_interleave(fmt.group_size, 1)
    assert ((w - linear.weight.detach()).abs() <= step / 2 * 1.01 + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_the_state_is_the_stored_values_and_scales(fmt: QuantFormat) -> None:
    layer = _quantized(nn.Linear(128, 32), fmt)
    state = layer.state_dict()
    assert sorted(state) == ["bias", "qweight", "scale"]
    want = torch.int8 if fmt.bits == 8 else torch.uint8
    assert state["qweight"].dtype == want
    assert tuple(state["qweight"].shape) == fmt.qweight_shape("w", (32, 128))
    assert tuple(state["scale"].shape) == fmt.scale_shape("w", (32, 128))
    assert not any(v.is_floating_point() and v.shape == (32, 128) for v in state.values())


def test_a_quantized_fc1_runs_its_gelu_in_the_layer() -> None:
    torch.manual_seed(1)
    mlp = MLP(64, 128)
    fmt = weight_format("int4", 64)
    plain = MLP(64, 128)
    plain.load_state_dict(mlp.state_dict())
    mlp.fc1 = _quantized(mlp.fc1, fmt)
    with torch.no_grad():
        plain.fc1.weight.copy_(mlp.fc1.dequantized(torch.float32))
    x = torch.randn(3, 64)
    assert torch.equal(mlp.fc1_gelu(x), F.gelu(plain.fc1(x), approximate="tanh"))
    assert torch.equal(mlp(x), plain(x))


def test_swap_and_names() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    swap_linears(model, ["0.weight"], weight_format("int8"))
    assert isinstance(model[0], QuantLinear) and model[0].qweight.is_meta
    with pytest.raises(ValueError, match="1: a LayerNorm, not a linear layer"):
        swap_linears(model, ["1.weight"], weight_format("int8"))
    with pytest.raises(ValueError, match=r"0.bias: not a linear layer's weight"):
        swap_linears(model, ["0.bias"], weight_format("int8"))
    names = module_names(
        {"a.weight.qweight": torch.zeros(1), "a.weight.scale": torch.zeros(1), "a.bias": 0}  # type: ignore[dict-item]
    )
    assert sorted(names) == ["a.bias", "a.qweight", "a.scale"]


@pytest.fixture(scope="module")
def qg() -> Iterator[ModuleType]:
    with interpreted_copy(quant_gemm) as mod:
        yield mod


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_the_kernel_path_equals_the_plain_path(
    qg: ModuleType, int4: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer's CUDA path (the kernels under Triton's interpreter, as if on CUDA): a decode
    step's few rows take the skinny kernel, a prompt's the tiled GEMM, the bias and the GELU in
    their epilogue; each equals the plain path up to the order of fp32 sums. fp32 activations
    and power-of-two bf16 scales: the interpreter's bf16 rounding truncates (module doc of
    tests/test_quant_gemm.py)."""
    g = torch.Generator().manual_seed(3)
    n, k = 48, 256
    qweight, scale = (ref.random_int4 if int4 else ref.random_int8)(
        n, k, g, torch.bfloat16, powers_of_two=True
    )
    fmt = weight_format("int4" if int4 else "int8", quant_gemm.GROUP)
    layer = QuantLinear(fmt, k, n)
    bias = torch.randn(n, generator=g)
    layer.load_state_dict({"qweight": qweight, "scale": scale, "bias": bias})
    calls: list[str] = []

    def spy(name: str) -> object:
        launch = getattr(qg, name)

        def run(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(qg, "supported", lambda x: True)
    for name in ("quant_skinny_linear", "quant_linear"):
        monkeypatch.setattr(qg, name, spy(name))
    for rows, kernel in ((1, "quant_skinny_linear"), (70, "quant_linear")):
        x = torch.randn(1, rows, k, generator=g)
        plain = layer(x), layer(x, gelu=True)
        monkeypatch.setattr(quant_linear, "quant_gemm", qg)
        got = layer(x), layer(x, gelu=True)
        monkeypatch.setattr(quant_linear, "quant_gemm", quant_gemm)
        assert calls[-2:] == [kernel, kernel]
        for a, b in zip(got, plain, strict=True):
            assert a.shape == (1, rows, n)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
