"""Moondream 3's decode products through the skinny kernel (text.py `SKINNY_PRODUCTS`), wired
on the CPU with a plain-PyTorch stand-in for the kernel: which products of a few-row step go
there (each block's QKV and output projection, the dense layers' fc1 with its GELU and fc2,
the routers), that wider steps and the switch's off position keep cuBLAS's, and that the
answers stay the plain path's. The kernel itself is checked elsewhere (tests/test_skinny_fma.py
in Triton's interpreter, the fused-product GPU tests)."""

from __future__ import annotations

import copy

import pytest
import torch

from image_pipeline import prepare_pil, sample_image
from vlm_server.models.common import skinny_gemm
from vlm_server.models.common.layers import gelu_tanh
from vlm_server.models.moondream3 import moe_routing, moe_triton, text
from vlm_server.models.moondream3.moe import MoeMLP
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator, SamplingSettings


class StandIn:
    """`skinny_linear` in PyTorch (the kernel's epilogue: bias, then the tanh GELU), counting
    the products by weight."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, int]] = []  # (weight id, GELU, rows)

    def __call__(self, x, weight, bias=None, *, gelu_from=None, **_: object):  # type: ignore[no-untyped-def]
        self.calls.append((id(weight), gelu_from == 0, x.numel() // x.shape[-1]))
        y = torch.nn.functional.linear(x, weight, bias)
        return gelu_tanh(y) if gelu_from == 0 else y


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    kernel = StandIn()
    rows = lambda x: x.numel() // x.shape[-1] if x.numel() else 0
    monkeypatch.setattr(skinny_gemm, "AVAILABLE", True)
    monkeypatch.setattr(skinny_gemm, "supported", lambda x: 0 < rows(x) <= skinny_gemm.MAX_ROWS)
    monkeypatch.setattr(skinny_gemm, "skinny_linear", kernel)
    return kernel


@pytest.fixture(scope="module")
def md3():  # type: ignore[no-untyped-def]
    return random_model(preset("moondream3-tiny"), dtype=torch.float32, progress=False)


def test_a_few_row_steps_products_take_the_kernel_and_the_answer_stays(
    md3,
    stand_in: StandIn,  # type: ignore[no-untyped-def]
) -> None:
    image = prepare_pil(sample_image())
    greedy = SamplingSettings(temperature=0, max_tokens=6)
    plain = ReferenceGenerator(md3.model, md3.tokenizer).query(image, "what?", greedy)
    assert stand_in.calls == []  # off until asked
    model = copy.deepcopy(md3.model)
    model.text.use_fused_products(True)
    fused = ReferenceGenerator(model, md3.tokenizer).query(image, "what?", greedy)
    assert fused.token_ids == plain.token_ids
    decoder = model.text
    attention = {id(b.attn.qkv.weight) for b in decoder.blocks} | {
        id(b.attn.proj.weight) for b in decoder.blocks
    }
    dense = [b.mlp for b in decoder.blocks if not isinstance(b.mlp, MoeMLP)]
    assert dense, "the tiny preset has dense layers"
    seen = {w for w, _, _ in stand_in.calls}
    assert attention <= seen
    assert {(id(m.fc1.weight), True) for m in dense} <= {(w, g) for w, g, _ in stand_in.calls}
    assert {id(m.fc2.weight) for m in dense} <= seen
    # Only steps of few rows: the prefix (hundreds of positions) stays on cuBLAS.
    assert max(r for _, _, r in stand_in.calls) <= skinny_gemm.MAX_ROWS


def test_the_switch_off_keeps_cublas(md3, stand_in: StandIn, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(text, "SKINNY_PRODUCTS", False)
    model = copy.deepcopy(md3.model)
    model.text.use_fused_products(True)
    ReferenceGenerator(model, md3.tokenizer).query(
        None, "hi", SamplingSettings(temperature=0, max_tokens=3)
    )
    assert stand_in.calls == []


def test_the_router_of_a_fused_expert_step_takes_the_kernel(
    md3,
    stand_in: StandIn,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    mlp = next(b.mlp for b in md3.model.text.blocks if isinstance(b.mlp, MoeMLP))
    mlp = copy.deepcopy(mlp)
    seen: dict[str, torch.Tensor] = {}

    def route_align(logits, top_k, bm):  # type: ignore[no-untyped-def]
        seen["logits"] = logits
        raise StopIteration  # enough: the grouping and the experts are not this test's

    monkeypatch.setattr(moe_routing, "route_align", route_align)
    monkeypatch.setattr(moe_triton, "pick_tiles", lambda n, table=None: moe_triton.TILES[0][1])
    x = torch.randn(3, mlp.router.in_features)
    for skinny, calls in ((False, 0), (True, 1)):
        mlp.skinny_router = skinny
        with pytest.raises(StopIteration):
            mlp._fused_pairs(x, None)
        torch.testing.assert_close(seen["logits"], mlp.router(x), rtol=0, atol=0)
        assert len(stand_in.calls) == calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_kernel_gives_moondream3_sized_products_as_cublas(rows: int) -> None:
    """Moondream 3's shapes (QKV 2048 -> 3072, a dense fc1 with its GELU 2048 -> 8192, fc2
    back, a router 2048 -> 64) in bf16, the kernel against cuBLAS."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    for n, k, gelu in (
        (3072, 2048, False),
        (8192, 2048, True),
        (2048, 8192, False),
        (64, 2048, False),
    ):
        layer = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        inp = x if k == 2048 else torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        got = skinny_gemm.layer_product(layer, inp, gelu=gelu)
        assert got is not None
        want = gelu_tanh(layer(inp)) if gelu else layer(inp)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
