"""Moondream 3's fused expert kernels over INT8 and INT4 expert weights (docs/quantization.md),
in Triton's interpreter on the CPU, against "dequantize, then the plain expert path"
(`moe.experts_loop` over `ExpertBank.values`), uneven expert loads included: one expert takes
every token, several take none.

Tolerance: the kernels widen each weight exactly as the dequantizer does (q * scale rounded to
the scale's bf16, then to the activations' dtype), so with fp32 activations the only
difference is the order of the fp32 sums: ``atol = rtol = 1e-4`` on outputs of order 1, as the
16-bit kernels' tests. The scales are powers of two here: Triton's interpreter rounds fp32 to
bf16 by truncating where torch rounds to nearest, and q * 2^-j is exact in bf16 either way.
(The interpreter's bf16 products are not usable, for the 16-bit kernels either: bf16
activations are checked on the GPU, tests/test_moondream3_moe_quant_gpu.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.interpreted import interpreted_moe
from vlm_server.models.moondream3 import moe, moe_triton
from vlm_server.models.moondream3.config import MoeConfig
from vlm_server.models.moondream3.moe_qweights import StoredExperts
from vlm_server.models.quant.formats import QuantFormat, weight_format

pytest.importorskip("triton")

ATOL = RTOL = 1e-4


kern = pytest.fixture(scope="module")(interpreted_moe)


def _fmt(name: str, group: int) -> QuantFormat:
    return weight_format(name, group)


def _stored(
    fmt: QuantFormat, shape: tuple[int, int, int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random values in ``fmt`` for experts of ``shape`` [E, out, in], power-of-two scales
    sized so that the weights are about 1 / sqrt(in) (outputs of order 1)."""
    q, scale = fmt.quantize("w", torch.randn(shape, generator=gen))
    top = fmt.bits - 1 + (shape[-1].bit_length() - 1) // 2  # 2^top ~ qmax * sqrt(in)
    exps = torch.randint(top, top + 3, tuple(scale.shape), generator=gen)
    return q, torch.exp2(-exps.float()).to(torch.bfloat16)


def _uneven_ids(n: int, k: int, e: int) -> torch.Tensor:
    """Expert 0 in every token's choice; the last ``e - 2k + 1`` experts in none."""
    assert 2 * k - 1 < e
    t = torch.arange(n)[:, None]
    rest = 1 + 2 * torch.arange(k - 1)[None, :] + t % 2  # 1|2, 3|4, ...
    return torch.cat([torch.zeros(n, 1, dtype=torch.long), rest], dim=1)


def _tile_cases(mt: SimpleNamespace) -> list[object]:
    t = mt.Tile
    return [
        *(tiles for _, tiles in mt.TILES),
        mt.ExpertTiles(16, t(32, 64, 4, 2, 3), t(32, 32, 4, 2, 2)),  # split K, uneven splits
    ]


N_TILE_CASES = len(moe_triton.TILES) + 1
# (format, group, experts, model width D, expert width I)
SHAPES = [("int8", 0, 8, 64, 32), ("int4", 32, 8, 64, 32), ("int4", 128, 6, 256, 128)]


# The widest shape under the split-K tiles (the last case) takes seconds under the
# interpreter: --run-slow runs it; the narrower shapes cover those tiles by default.
@pytest.mark.parametrize(
    ("shape", "case"),
    [
        pytest.param(
            shape,
            case,
            id=f"{shape[0]}g{shape[1]}-{case}",
            marks=pytest.mark.slow if shape is SHAPES[-1] and case == N_TILE_CASES - 1 else (),
        )
        for shape in SHAPES
        for case in range(N_TILE_CASES)
    ],
)
def test_quantized_experts_equal_the_dequantized_loop(
    kern: SimpleNamespace, case: int, shape: tuple[str, int, int, int, int]
) -> None:
    name, group, e, d, i = shape
    fmt, gen = _fmt(name, group), torch.Generator().manual_seed(case)
    n, k = 23, 3
    x = torch.randn(n, d, generator=gen)
    ids = _uneven_ids(n, k, e)
    q1, s1 = _stored(fmt, (e, 2 * i, d), gen)
    q2, s2 = _stored(fmt, (e, d, i), gen)
    tiles = _tile_cases(kern.triton)[case]
    got = kern.triton.experts_fused(x, ids, q1, q2, s1, s2, tiles=tiles)
    d1, d2 = (fmt.dequantize(q, s, torch.bfloat16).float() for q, s in ((q1, s1), (q2, s2)))
    torch.testing.assert_close(got, moe.experts_loop(x, ids, d1, d2), atol=ATOL, rtol=RTOL)


def test_an_adapter_on_quantized_experts(kern: SimpleNamespace) -> None:
    from tests.test_moondream3_moe_kernels import _delta

    fmt, gen = _fmt("int8", 0), torch.Generator().manual_seed(7)
    e, d, i, n, k = 8, 64, 32, 11, 3
    x = torch.randn(n, d, generator=gen)
    ids = _uneven_ids(n, k, e)
    (q1, s1), (q2, s2) = _stored(fmt, (e, 2 * i, d), gen), _stored(fmt, (e, d, i), gen)
    delta = _delta(d, i, seed=2)
    got = kern.triton.experts_fused(x, ids, q1, q2, s1, s2, delta)
    d1, d2 = (fmt.dequantize(q, s).float() for q, s in ((q1, s1), (q2, s2)))
    want = moe.experts_loop_lora(x, ids, d1, d2, delta)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def _quantized_mlp(fmt: QuantFormat, gen: torch.Generator) -> moe.MoeMLP:
    mlp = moe.MoeMLP(64, MoeConfig(n_experts=8, top_k=3, expert_dim=32, start_layer=0))
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=gen)
    for bank in (mlp.fc1, mlp.fc2):
        q, s = _stored(fmt, bank.shape, gen)
        bank.hold_quantized(fmt)
        bank.qweight.copy_(q)
        bank.scale.copy_(s)
    return mlp


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_fused_layer_equals_the_plain_layer(
    kern: SimpleNamespace, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MoeMLP` with quantized banks: router, route + grouping, the grouped kernels over the
    stored values, combine; against the loop over the dequantized values."""
    monkeypatch.setattr(moe, "moe_triton", kern.triton)
    monkeypatch.setattr(moe, "moe_routing", kern.routing)
    mlp = _quantized_mlp(_fmt(fmt, 32), torch.Generator().manual_seed(3))
    h = torch.randn(1, 19, 64, generator=torch.Generator().manual_seed(4))
    mlp.method = "loop"
    want = mlp(h)
    mlp.method = "fused"
    torch.testing.assert_close(mlp(h), want, atol=ATOL, rtol=RTOL)


# ---- the bank's state ------------------------------------------------------------------------


def test_a_quantized_bank_holds_no_16_bit_weights() -> None:
    fmt = _fmt("int4", 32)
    mlp = _quantized_mlp(fmt, torch.Generator().manual_seed(1))
    bank = mlp.fc1
    assert bank.format == "int4" and not list(bank.parameters())
    assert sorted(bank.state_dict()) == ["qweight", "scale"]
    assert bank.qweight.dtype == torch.uint8 and bank.scale.dtype == torch.bfloat16
    assert bank.qweight.shape == (8, 64, 32) and bank.scale.shape == (8, 64, 2)
    torch.testing.assert_close(
        bank.values(torch.float32), fmt.dequantize(bank.qweight, bank.scale).float()
    )
    mlp.to(torch.float16)  # the scales are the format's: never cast
    assert bank.scale.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="held in int4, not 16-bit"):
        bank.use_fp8()
    with pytest.raises(ValueError, match="FP8 activations need the experts' weights in FP8"):
        mlp.use_fp8_activations()


def test_stored_experts_refuse_scales_that_do_not_fit() -> None:
    q1, s1 = _fmt("int4", 32).quantize("w", torch.randn(4, 16, 64))
    q2, s2 = _fmt("int4", 32).quantize("w", torch.randn(4, 64, 8 * 4))
    assert StoredExperts.of(q1, s1, q2, s2) == StoredExperts(4, 32, (4, 16, 64))
    with pytest.raises(ValueError, match=r"fc2: scales \[4, 64\] do not fit 4-bit weights"):
        StoredExperts.of(q1, s1, q2, s2[..., 0])
    with pytest.raises(ValueError, match="need their scales"):
        StoredExperts.of(q1, None, q2, s2)
    with pytest.raises(ValueError, match=r"torch.uint8 \(fc1\) and torch.bfloat16 \(fc2\)"):
        StoredExperts.of(q1, s1, torch.zeros(4, 64, 32, dtype=torch.bfloat16), None)
