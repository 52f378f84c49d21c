"""The products over INT8 and INT4 weights on the GPU (models/common/quant_gemm.py): over
random shapes, row counts and launch shapes, each equals "dequantize, then the plain
product" (tests/support/quant_reference.py) up to the order of its fp32 sums (one bf16
rounding of the output either way); and the decode launch replays in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support import quant_reference as ref
from vlm_server.models.common import quant_gemm

pytestmark = pytest.mark.gpu


def _weight(int4: bool, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    qw, s = ref.random_int4(n, k, g) if int4 else ref.random_int8(n, k, g)
    return qw.cuda(), s.cuda()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp32 summation error of the fp64 sums, then the output's rounding (a sum
    order may flip its last bit)."""
    atol = 1e-5 * want.abs().max().item()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-5)
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.double(), want.to(got.dtype).double(), atol=atol, rtol=eps)


def _shapes(seed: int, count: int) -> list[tuple[int, int]]:
    """Random (n, k): n in 1..1500, k a multiple of 128 up to 4096; and moondream2's decode
    widths (QKV + fc1 over 2048, fc2 over 8192)."""
    g = torch.Generator().manual_seed(seed)
    ns = torch.randint(1, 1500, (count,), generator=g).tolist()
    ks = (128 * torch.randint(1, 33, (count,), generator=g)).tolist()
    return [*zip(ns, ks, strict=True), (3 * 2048 + 8192, 2048), (2048, 8192)]


SKINNY_CONFIGS = [
    None,
    quant_gemm.SkinnyConfig(2, 1024, 4, 1, 4, fma=True),
    quant_gemm.SkinnyConfig(64, 128, 4, 4, 1),
    quant_gemm.SkinnyConfig(32, 256, 8, 3, 8),
]


@pytest.mark.parametrize("config", SKINNY_CONFIGS, ids=["default", "fma-split", "whole", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 64])
def test_the_skinny_product_equals_dequantize_then_matmul(
    rows: int, int4: bool, dtype: torch.dtype, config: quant_gemm.SkinnyConfig | None
) -> None:
    g = torch.Generator().manual_seed(rows)
    for n, k in _shapes(rows, 4):
        qw, s = _weight(int4, n, k, g)
        x = torch.randn(rows, k, generator=g).to(dtype).cuda()
        b = torch.randn(n, generator=g).to(dtype).cuda()
        got = quant_gemm.quant_skinny_linear(x, qw, s, b, config=config)
        _close(got, ref.reference(x, qw, s, b))


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 32])
def test_the_skinny_epilogue_on_the_gpu(rows: int, int4: bool) -> None:
    g = torch.Generator().manual_seed(5)
    n, k = 520, 1024
    qw, s = _weight(int4, n, k, g)
    x = torch.randn(rows, k, generator=g).bfloat16().cuda()
    r = torch.randn(rows, n, generator=g).bfloat16().cuda()
    got = quant_gemm.quant_skinny_linear(x, qw, s, residual=r, gelu_from=136)
    want = ref.reference(x, qw, s)
    want[:, 136:] = F.gelu(want[:, 136:], approximate="tanh")
    want = want.to(torch.bfloat16).double() + r.double()
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 65, 200, 729])
def test_the_prefill_product_equals_dequantize_then_matmul(
    rows: int, int4: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(1000 + rows)
    for n, k in _shapes(1000 + rows, 3):
        qw, s = _weight(int4, n, k, g)
        x = torch.randn(rows, k, generator=g).to(dtype).cuda()
        b = torch.randn(n, generator=g).to(dtype).cuda()
        got = quant_gemm.quant_linear(x, qw, s, b)
        _close(got, ref.reference(x, qw, s, b))


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_the_products_agree_with_the_plain_bf16_path(int4: bool) -> None:
    """Against F.linear over the dequantized weight itself (cuBLAS, fp32 sums)."""
    g = torch.Generator().manual_seed(9)
    qw, s = _weight(int4, 2048, 2048, g)
    w = ref.dequantize(qw, s)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 2048, generator=g).bfloat16().cuda()
        plain = F.linear(x, w).double()
        launch = quant_gemm.quant_skinny_linear if rows <= quant_gemm.MAX_ROWS else None
        got = (launch or quant_gemm.quant_linear)(x, qw, s)
        eps = torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(got.double(), plain, atol=1e-3, rtol=2 * eps)


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_decode_launch_replays_in_a_cuda_graph(rows: int, int4: bool) -> None:
    g = torch.Generator().manual_seed(11)
    qw, s = _weight(int4, 3000, 2048, g)
    b = torch.randn(3000, generator=g).bfloat16().cuda()
    x = torch.randn(rows, 2048, generator=g).bfloat16().cuda()
    quant_gemm.quant_skinny_linear(x, qw, s, b)  # compiled before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = quant_gemm.quant_skinny_linear(x, qw, s, b)
    for seed in (1, 2):
        x.copy_(torch.randn(rows, 2048, generator=g.manual_seed(seed)).bfloat16().cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, quant_gemm.quant_skinny_linear(x, qw, s, b))
