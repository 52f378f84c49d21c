"""The fused skinny products on the GPU: the kernel against PyTorch over random shapes and
row counts, and the decoder's fused few-row forward against its four-product forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from vlm_server.models.common import skinny_gemm
from vlm_server.models.interface import LoadedModel

pytestmark = pytest.mark.gpu


CONFIGS = [
    None,
    skinny_gemm.SkinnyConfig(64, 128, 4, 4, 1),
    skinny_gemm.SkinnyConfig(32, 64, 8, 3, 8),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "whole-k", "split-8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32])
def test_skinny_linear_matches_pytorch(
    dtype: torch.dtype, rows: int, config: skinny_gemm.SkinnyConfig | None
) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    for n, k1, k2, gelu_from, res in [
        (200, 96, 0, None, False),
        (300, 64, 160, None, True),
        (520, 128, 0, 136, False),
        (72, 2048, 8192, None, False),
    ]:
        x1 = torch.randn(rows, k1, device="cuda", generator=g).to(dtype)
        x2 = torch.randn(rows, k2, device="cuda", generator=g).to(dtype) if k2 else None
        w = (torch.randn(n, k1 + k2, device="cuda", generator=g) / (k1 + k2) ** 0.5).to(dtype)
        b = torch.randn(n, device="cuda", generator=g).to(dtype)
        r = torch.randn(rows, n, device="cuda", generator=g).to(dtype) if res else None
        got = skinny_gemm.skinny_linear(
            x1, w, b, x2=x2, residual=r, gelu_from=gelu_from, config=config
        )
        x = x1 if x2 is None else torch.cat([x1, x2], 1)
        want = x.double() @ w.double().t() + b.double()
        if gelu_from is not None:
            want[:, gelu_from:] = F.gelu(want[:, gelu_from:], approximate="tanh")
        if r is not None:
            want = want.to(dtype).double() + r.double()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 17, 32])
def test_the_shrink_riding_the_product_at_moondream2_widths(rows: int) -> None:
    """moondream2's two decode products (bf16) with every slot's stacked A beside them (8
    slots, rank 32): the product's columns bit for bit those of the plain launch, the shrink
    to bf16 rounding; and the launch replays in a CUDA graph with new weights in a slot."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    d, ff, slots, r = 2048, 8192, 8, 32

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * 0.05).bfloat16()

    h, hidden = rnd(rows, d), rnd(rows, ff)
    w_in, b_in, w_out, b_out = rnd(3 * d + ff, d), rnd(3 * d + ff), rnd(d, d + ff), rnd(d)
    bank_in, bank_fc2 = rnd(slots, 3, 3 * r, d), rnd(slots, 3, r, ff)  # [slots, layers, ...]
    for x1, x2, w, b, a, partials in [
        (h, None, w_in, b_in, bank_in[:, 1], False),
        (rnd(rows, d), hidden, w_out, b_out, bank_fc2[:, 1], True),
    ]:
        y, sums = skinny_gemm.skinny_linear_shrink(x1, w, b, a, x2=x2, partials=partials)
        assert torch.equal(y, skinny_gemm.skinny_linear(x1, w, b, x2=x2, partials=partials))
        src = x1 if x2 is None else x2
        want = torch.einsum("mk,srk->msr", src.double(), a.double()).reshape(rows, -1)
        torch.testing.assert_close(sums.double().sum(0), want, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, captured = skinny_gemm.skinny_linear_shrink(h, w_in, b_in, bank_in[:, 1])
    bank_in[3].copy_(rnd(3, 3 * r, d))
    graph.replay()
    _, eager = skinny_gemm.skinny_linear_shrink(h, w_in, b_in, bank_in[:, 1])
    assert torch.equal(captured, eager)


def test_more_rows_than_the_cap_take_the_plain_products() -> None:
    x = torch.zeros(skinny_gemm.MAX_ROWS + 1, 64, device="cuda")
    assert not skinny_gemm.supported(x) and skinny_gemm.supported(x[:-1])


def test_skinny_linear_is_deterministic() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(7, 2048, device="cuda", generator=g).bfloat16()
    w = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    first = skinny_gemm.skinny_linear(x, w)
    for _ in range(5):
        assert torch.equal(skinny_gemm.skinny_linear(x, w), first)


@pytest.mark.parametrize("rows", [1, 3, 17, 32, 64])
def test_fused_decode_forward_matches_the_four_products(tiny: LoadedModel, rows: int) -> None:
    """One decode position per row through the paged cache's fused attention, with and without
    the stacked products (fp32: the two agree to rounding)."""
    from vlm_server.engine.device.kernels.paged_attention import DecodeKV

    model = copy.deepcopy(tiny.model).cuda()
    text = model.text
    cfg = text.cfg
    page = 16
    pages = rows * 4 + 1  # every row its own pages: no two rows write one slot
    g = torch.Generator(device="cuda").manual_seed(rows)
    kvh, hd = cfg.n_kv_heads, cfg.head_dim
    shape = (pages, page, kvh, hd)
    k0 = [torch.randn(shape, device="cuda", generator=g) for _ in range(cfg.n_layers)]
    v0 = [torch.randn(shape, device="cuda", generator=g) for _ in range(cfg.n_layers)]
    table = torch.arange(1, rows * 4 + 1, device="cuda", dtype=torch.int32).view(rows, 4)
    row_ids = torch.arange(rows, device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 4 * page, (rows, 1), device="cuda", generator=g)
    x = torch.randn(rows, 1, cfg.dim, device="cuda", generator=g)

    def run() -> torch.Tensor:
        ks, vs = [k.clone() for k in k0], [v.clone() for v in v0]
        cache = DecodeKV(
            ks, vs, table, row_ids, 4, (text.rope_cos, text.rope_sin), cfg.n_heads, True
        )
        return text(x, positions, cache)

    plain = run()
    plain_logits = text.logits(plain)
    assert text.use_fused_products(True)
    fused = run()
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(text.logits(plain), plain_logits, atol=1e-4, rtol=1e-4)
