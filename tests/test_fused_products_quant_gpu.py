"""The fused decode products over 8- and 4-bit weights on the GPU (run on a CUDA machine;
skipped elsewhere), at moondream2's sizes in bf16: each product a decode step takes equals
the 16-bit fused product over the dequantized weights bit for bit (the same tiles and sums
over the same widened values), at 1 and 32 rows; the quantized decoder's fused step against
its unfused step (the quantized layers' kernels) within bf16 rounding; and the fused step
time beside the unfused one is printed (``-s`` shows it). The engine over quantized weights,
fused decode on, against the reference: tests/test_quant_serving_gpu.py.

    python -m pytest -q -s tests/test_fused_products_quant_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.quant_reference import block_outputs
from vlm_server.models.common import fused_products
from vlm_server.models.common.layers import LayerNorm
from vlm_server.models.common.quant_linear import QuantLinear
from vlm_server.models.interface import LoadedModel
from vlm_server.models.quant.formats import QuantFormat, weight_format
from vlm_server.models.registry import preset, random_model

pytestmark = pytest.mark.gpu

D, QKV, FF = 2048, 3 * 2048, 8192  # moondream2's block
FORMATS = [weight_format("int8"), weight_format("int4", 128)]
# The quantized decoder's fused step against its unfused one: the same weights, fp32 sums in
# another order, each product rounded to bf16, 24 blocks of them.
STEP_LOGITS_REL_ERR = 2e-2


def _layer(n: int, k: int, fmt: QuantFormat, g: torch.Generator) -> QuantLinear:
    linear = nn.Linear(k, n, device="cuda")
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        linear.bias.copy_(torch.randn(n, device="cuda", generator=g) * 0.1)
    layer = QuantLinear.like(linear, fmt)
    q, s = fmt.quantize("weight", linear.weight.detach())
    layer.load_state_dict({"qweight": q, "scale": s, "bias": linear.bias.detach()})
    return layer.to(torch.bfloat16)


def _twin(layer: QuantLinear) -> nn.Linear:
    plain = nn.Linear(layer.in_features, layer.out_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        plain.weight.copy_(layer.dequantized(torch.bfloat16))
        assert layer.bias is not None
        plain.bias.copy_(layer.bias)
    return plain


@pytest.mark.parametrize("fmt", FORMATS, ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 32])
def test_the_block_products_equal_the_dequantized_ones(fmt: QuantFormat, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    shapes = ((QKV, D), (FF, D), (D, D), (D, FF))
    layers = [_layer(n, k, fmt, g) for n, k in shapes]
    twins = [_twin(m) for m in layers]
    quant, dense = fused_products.stack_block(*layers), fused_products.stack_block(*twins)
    h, x, attn = (torch.randn(rows, D, device="cuda", generator=g).bfloat16() for _ in range(3))
    norm = LayerNorm(D).cuda().bfloat16()
    with torch.inference_mode():
        outs = [block_outputs(prod, h, x, attn, norm) for prod in (quant, dense)]
    torch.cuda.synchronize()
    for got, want in zip(*outs, strict=True):
        assert torch.equal(got, want)


def _md2(weights: str) -> LoadedModel:
    return random_model(
        preset("moondream2"),
        seed=0,
        dtype=torch.bfloat16,
        device="cuda",
        progress=False,
        weights=weights,
    )


def _step_logits(loaded: LoadedModel, fused: bool, rows: int) -> tuple[torch.Tensor, float]:
    """One decode position per row through the paged cache's fused attention (random pages,
    each row its own): (logits, ms of the forward, median of 20; eager, no graphs)."""
    from vlm_server.engine.device.kernels.paged_attention import DecodeKV

    text = loaded.model.text
    assert text.use_fused_products(fused) == fused
    cfg, page = text.cfg, 16
    g = torch.Generator(device="cuda").manual_seed(rows)
    shape = (rows * 4 + 1, page, cfg.n_kv_heads, cfg.head_dim)
    k0 = [torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(cfg.n_layers)]
    v0 = [torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(cfg.n_layers)]
    table = torch.arange(1, rows * 4 + 1, device="cuda", dtype=torch.int32).view(rows, 4)
    row_ids = torch.arange(rows, device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 4 * page, (rows, 1), device="cuda", generator=g)
    x = torch.randn(rows, 1, cfg.dim, device="cuda", generator=g).bfloat16()
    times = []
    with torch.inference_mode():
        for _ in range(20):
            ks, vs = [k.clone() for k in k0], [v.clone() for v in v0]
            rope = (text.rope_cos, text.rope_sin)
            cache = DecodeKV(ks, vs, table, row_ids, 4, rope, cfg.n_heads, True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = text.logits(text(x, positions, cache))
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return logits.float(), sorted(times)[len(times) // 2]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_fused_step_answers_as_the_unfused_one(weights: str) -> None:
    """The same quantized model's decode step with the fused products and without (the
    quantized layers' own skinny kernels)."""
    loaded = _md2(weights)
    for rows in (1, 32):
        want, unfused_ms = _step_logits(loaded, False, rows)
        got, fused_ms = _step_logits(loaded, True, rows)
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(
            f"\n{weights} {rows} rows: fused vs unfused step max rel err {rel:.2e}, top-1 "
            f"{top1}; forward {fused_ms:.3f} ms fused, {unfused_ms:.3f} unfused (eager)"
        )
        assert rel < STEP_LOGITS_REL_ERR
        assert top1 >= 0.9
