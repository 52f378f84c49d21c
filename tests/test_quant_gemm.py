"""The products over INT8 and INT4 weights (models/common/quant_gemm.py), on the CPU through
Triton's interpreter at tiny shapes: each launch against "dequantize, then the plain
product" (tests/support/quant_reference.py), equal up to the order of the fp32 sums; rows
and columns that are not multiples of the tiles; the layout's packing; bad weights refused.

The interpreter's tensor-core dot is wrong in bf16 and it rounds fp32 to bf16 by truncating
(NumPy has no bf16): the tensor-core launches run on fp16 and fp32 activations here, bf16 on
the CUDA cores; bf16 scales are powers of two (the widened weight then needs no rounding),
and fp16 scales (rounded to nearest, as a GPU rounds) check where the rounding falls. The
GPU file (test_quant_gemm_gpu.py) runs bf16 activations and scales throughout."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tests.support import quant_reference as ref
from tests.support.interpreted import interpreted_copy
from vlm_server.models.common import quant_gemm

K, N = 256, 48


@pytest.fixture(scope="module")
def qg() -> Iterator[ModuleType]:
    with interpreted_copy(quant_gemm) as mod:
        yield mod


def _weight(int4: bool, seed: int, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 activations take bf16 scales (powers of two); others fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    bf16 = act == torch.bfloat16
    dtype = torch.bfloat16 if bf16 else torch.float16
    make = ref.random_int4 if int4 else ref.random_int8
    return make(N, K, g, dtype, powers_of_two=bf16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 outputs: within fp32 summation error; 16-bit ones: the reference rounded to
    their dtype, give or take the last bit a different sum order may flip."""
    if got.dtype == torch.float32:
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-5)
    else:
        eps = torch.finfo(got.dtype).eps
        atol = 1e-5 * want.abs().max().item()
        torch.testing.assert_close(got.double(), want.to(got.dtype).double(), atol=atol, rtol=eps)


def test_the_int4_packing_round_trips() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 256), generator=g, dtype=torch.int8)
    packed = ref.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 128)
    assert torch.equal(ref.unpack_int4(packed), q)
    assert packed[0, 0].item() == (int(q[0, 0]) & 0xF) | ((int(q[0, 1]) & 0xF) << 4)


SKINNY = [
    # rows, dtype, block_n, block_k, split, fma, bias
    (1, torch.bfloat16, 2, 64, 1, True, True),
    (1, torch.float32, 4, 128, 3, True, False),
    (3, torch.bfloat16, 4, 32, 2, True, True),
    (3, torch.float16, 32, 64, 1, False, True),
    (17, torch.float32, 32, 128, 2, False, False),
    (17, torch.float16, 16, 256, 1, False, True),
]


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
@pytest.mark.parametrize("case", range(len(SKINNY)))
def test_the_skinny_product_equals_dequantize_then_matmul(
    qg: ModuleType, case: int, int4: bool
) -> None:
    m, dtype, bn, bk, split, fma, has_b = SKINNY[case]
    qw, s = _weight(int4, case, dtype)
    g = torch.Generator().manual_seed(100 + case)
    x = torch.randn(m, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if has_b else None
    cfg = qg.SkinnyConfig(bn, bk, 4, 1, split, fma=fma)
    got = qg.quant_skinny_linear(x, qw, s, b, config=cfg)
    assert got.shape == (m, N) and got.dtype == dtype
    _close(got, ref.reference(x, qw, s, b))


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_the_skinny_epilogue_adds_gelu_and_residual(qg: ModuleType, int4: bool) -> None:
    qw, s = _weight(int4, 7, torch.float32)
    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(2, 1, K, generator=g), torch.randn(2, 1, N, generator=g)
    cfg = qg.SkinnyConfig(8, 64, 4, 1, 2, fma=True)
    got = qg.quant_skinny_linear(x, qw, s, residual=r, gelu_from=20, config=cfg)
    want = ref.reference(x.reshape(2, K), qw, s)
    want[:, 20:] = F.gelu(want[:, 20:], approximate="tanh")
    assert got.shape == (2, 1, N)
    _close(got.reshape(2, N), want + r.reshape(2, N).double())


PREFILL = [
    # rows, dtype, block_m, block_n, block_k, bias
    (17, torch.float32, 16, 32, 64, True),
    (17, torch.float16, 16, 32, 128, False),
    (3, torch.float32, 16, 16, 256, False),
]


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
@pytest.mark.parametrize("case", range(len(PREFILL)))
def test_the_prefill_product_equals_dequantize_then_matmul(
    qg: ModuleType, case: int, int4: bool
) -> None:
    m, dtype, bm, bn, bk, has_b = PREFILL[case]
    qw, s = _weight(int4, 20 + case, dtype)
    g = torch.Generator().manual_seed(200 + case)
    x = torch.randn(m, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if has_b else None
    got = qg.quant_linear(x, qw, s, b, config=qg.PrefillConfig(bm, bn, bk, 4, 1))
    assert got.shape == (m, N) and got.dtype == dtype
    _close(got, ref.reference(x, qw, s, b))


def test_bad_weights_are_refused_naming_the_field() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, K)
    q8, s8 = ref.random_int8(N, K, g)
    q4, s4 = ref.random_int4(N, K, g)
    with pytest.raises(ValueError, match="qweight"):
        quant_gemm.quant_skinny_linear(x[:, :200], q8, s8)
    with pytest.raises(ValueError, match="scale"):
        quant_gemm.quant_skinny_linear(x, q8, s4)
    with pytest.raises(ValueError, match="scale"):
        quant_gemm.quant_linear(x, q4, s8)
    with pytest.raises(ValueError, match="qweight"):
        quant_gemm.quant_linear(x, q8.float(), s8)
    with pytest.raises(ValueError, match="multiple of 128"):
        quant_gemm.quant_linear(x[:, :192], q4[:, :96], s4[:, :1])
    with pytest.raises(ValueError, match="rows"):
        quant_gemm.quant_skinny_linear(torch.randn(65, K), q8, s8)


def test_the_launch_configs_cover_both_formats_and_kernels() -> None:
    from vlm_server.chips import CHIPS

    launches = quant_gemm.launch_configs(CHIPS[0])
    kernels = {(launch.kernel, launch.constants.get("INT4")) for launch in launches}
    assert {("_quant_skinny_kernel", False), ("_quant_skinny_kernel", True)} <= kernels
    assert {("_quant_gemm_kernel", False), ("_quant_gemm_kernel", True)} <= kernels
    assert ("_quant_split_sum_kernel", None) in kernels
    for launch in launches:
        if "INT4" in launch.constants:
            assert launch.types["w_ptr"] == ("*u8" if launch.constants["INT4"] else "*i8")
