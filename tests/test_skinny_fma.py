"""The skinny product's CUDA-core launch (``SkinnyConfig.fma``), on the CPU through Triton's
interpreter: against PyTorch over rows, widths, splits, both inputs, every epilogue, split
sums and the riding shrink; and the default launch shape's choice of it."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import interpreted_copy
from vlm_server.models.common import skinny_gemm


@pytest.fixture(scope="module")
def sg() -> Iterator[ModuleType]:
    with interpreted_copy(skinny_gemm) as mod:
        yield mod


CASES = [
    # rows, n, k1, k2, block_n, block_k, split, bias, residual, gelu_from
    (1, 40, 48, 0, 2, 64, 1, True, False, None),
    (1, 33, 96, 160, 2, 64, 3, False, True, None),
    (2, 24, 64, 0, 4, 32, 2, True, False, 10),
    (3, 17, 40, 24, 2, 32, 1, True, True, None),
    (4, 64, 128, 0, 8, 64, 4, False, False, 0),
    (1, 7, 200, 0, 1, 128, 2, True, False, None),
]


def _want(x1, x2, w, b, r, gelu_from, dtype):
    x = x1 if x2 is None else torch.cat([x1, x2], 1)
    want = x.double() @ w.double().t()
    if b is not None:
        want = want + b.double()
    if gelu_from is not None:
        want[:, gelu_from:] = F.gelu(want[:, gelu_from:], approximate="tanh")
    if r is not None:
        want = want.to(dtype).double() + r.double()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_cuda_core_launch_equals_torch(sg: ModuleType, case: int, dtype: torch.dtype) -> None:
    m, n, k1, k2, bn, bk, split, has_b, has_r, gelu_from = CASES[case]
    g = torch.Generator().manual_seed(case)
    x1 = torch.randn(m, k1, generator=g).to(dtype)
    x2 = torch.randn(m, k2, generator=g).to(dtype) if k2 else None
    w = (torch.randn(n, k1 + k2, generator=g) / (k1 + k2) ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if has_b else None
    r = torch.randn(m, n, generator=g).to(dtype) if has_r else None
    cfg = sg.SkinnyConfig(bn, bk, 4, 1, split, fma=True)
    got = sg.skinny_linear(x1, w, b, x2=x2, residual=r, gelu_from=gelu_from, config=cfg)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = _want(x1, x2, w, b, r, gelu_from, dtype)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", [1, 2, 4])
def test_the_cuda_core_launchs_split_sums_add_up(sg: ModuleType, case: int) -> None:
    m, n, k1, k2, bn, bk, split, *_ = CASES[case]
    g = torch.Generator().manual_seed(10 + case)
    x1, w = torch.randn(m, k1, generator=g), torch.randn(n, k1 + k2, generator=g)
    x2 = torch.randn(m, k2, generator=g) if k2 else None
    cfg = sg.SkinnyConfig(bn, bk, 4, 1, split, fma=True)
    sums = torch.full((split, m, n), float("nan"))
    out = sg.skinny_linear(x1, w, x2=x2, config=cfg, sums_out=sums)
    assert out is sums and not sums.isnan().any()  # every slice written, empty ones as zeros
    want = _want(x1, x2, w, None, None, None, torch.float32)
    torch.testing.assert_close(sums.double().sum(0), want, atol=1e-4, rtol=1e-4)


def test_the_shrink_rides_the_cuda_core_launch(sg: ModuleType) -> None:
    """The product's own columns bit for bit those of the plain launch; the shrink's split
    sums equal the input times every slot's rows."""
    g = torch.Generator().manual_seed(3)
    m, n, k, slots, rs = 1, 30, 96, 3, 5
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    a = torch.randn(slots, rs, k, generator=g)
    cfg = sg.SkinnyConfig(2, 32, 4, 1, 2, fma=True)
    y, sums = sg.skinny_linear_shrink(x, w, b, a, config=cfg, partials=True)
    assert torch.equal(y, sg.skinny_linear(x, w, b, config=cfg, partials=True))
    want = torch.einsum("mk,srk->msr", x.double(), a.double()).reshape(m, -1)
    torch.testing.assert_close(sums.double().sum(0), want, atol=1e-4, rtol=1e-4)


def test_the_default_launch_at_one_row_is_the_cuda_core_one(sg: ModuleType) -> None:
    """One 16-bit row takes the CUDA cores by default and agrees with the tensor-core
    launch; more rows, or fp32 weights, keep the tensor-core tiles."""
    g = torch.Generator().manual_seed(5)
    # fp16: the interpreter's tensor-core dot is wrong in bf16 (NumPy has no bf16).
    w = (torch.randn(72, 300, generator=g) / 300**0.5).half()
    x = torch.randn(1, 300, generator=g).half()
    assert sg.default_config(1, 72, 300).fma
    assert not sg.default_config(sg.FMA_MAX_ROWS + 1, 72, 300).fma
    assert not sg.default_config(1, 72, 300, itemsize=4).fma
    tiles = sg.skinny_linear(x, w, config=sg.SkinnyConfig(16, 64, 4, 1, 1))
    torch.testing.assert_close(sg.skinny_linear(x, w).float(), tiles.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("k", [1, 7, 64, 1000, 1024, 1025, 2048, 8192, 10240, 9000, 65536])
@pytest.mark.parametrize("n", [64, 4096, 4097])
def test_the_default_split_leaves_no_slice_of_k_empty(n: int, k: int) -> None:
    cfg = skinny_gemm.default_config(1, n, k)
    assert cfg.fma and 1 <= cfg.split_k <= 8 and cfg.block_k <= skinny_gemm.FMA_BLOCK_K
    steps = -(-k // cfg.block_k)
    per_split = -(-steps // cfg.split_k) * cfg.block_k
    assert (cfg.split_k - 1) * per_split < k  # the last slice starts inside K
    if n > 4096:
        assert cfg.split_k == 1
