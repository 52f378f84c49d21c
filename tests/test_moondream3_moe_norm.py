"""The expert combine fused into the residual add and norm (models/moondream3/moe_norm.py):
under Triton's interpreter against the two kernels it replaces and the plain ops, on CUDA
against the two kernels, and the decoder's expert layers taking it only where they may."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import interpreted
from vlm_server.models.common import fused_norm
from vlm_server.models.common.layers import LN_EPS, LayerNorm
from vlm_server.models.moondream3 import moe_norm, moe_routing
from vlm_server.models.moondream3.moe import combine_slots


@pytest.fixture(scope="module")
def kern() -> Iterator[SimpleNamespace]:
    pytest.importorskip("triton")
    copies = [interpreted(m) for m in (moe_norm, fused_norm, moe_routing)]
    yield SimpleNamespace(norm=copies[0], fused=copies[1], routing=copies[2])
    for m in copies:
        del sys.modules[m.__name__]


def _inputs(n: int, k: int, d: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    weights = torch.softmax(torch.randn(n, k, generator=gen), -1).to(dtype)
    norm = LayerNorm(d).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(r(d, scale=0.2) + 1)
        norm.bias.copy_(r(d, scale=0.1))
    return r(n, d), r(n, d), r(n, k, d), weights, norm


def _fused(kern: SimpleNamespace, x, a, y, w, norm) -> tuple[torch.Tensor, torch.Tensor]:
    n, k, d = y.shape
    s, out = torch.empty_like(x), torch.empty_like(x)
    kern.norm._add_combine_layernorm_kernel[(n,)](
        x, a, y, w, norm.weight, norm.bias, s, out, d, k, LN_EPS, BLOCK=1 << (d - 1).bit_length()
    )
    return s, out


def _two_kernels(kern: SimpleNamespace, x, a, y, w, norm) -> tuple[torch.Tensor, torch.Tensor]:
    n, k, d = y.shape
    m = torch.empty_like(x)
    kern.routing._combine_kernel[(n, -(-d // 64))](y, w, m, d, k, BD=64)
    s, out = torch.empty_like(x), torch.empty_like(x)
    kern.fused._add_layernorm_kernel[(n,)](
        x, a, m, norm.weight, norm.bias, s, out, d, LN_EPS, HAS_B=True,
        BLOCK=1 << (d - 1).bit_length(),
    )  # fmt: skip
    return s, out


@pytest.mark.parametrize("n, k, d", [(1, 8, 64), (5, 3, 100), (3, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_kernel_gives_what_the_combine_and_norm_kernels_give(
    kern: SimpleNamespace, n: int, k: int, d: int, dtype: torch.dtype
) -> None:
    x, a, y, w, norm = _inputs(n, k, d, dtype, seed=n + k)
    s, out = _fused(kern, x, a, y, w, norm)
    s2, out2 = _two_kernels(kern, x, a, y, w, norm)
    assert torch.equal(s, s2) and torch.equal(out, out2)
    if dtype == torch.float32:  # the plain ops: the residual exactly, the norm to rounding
        want = x + a + combine_slots(y, w)
        assert torch.equal(s, want)
        ln = F.layer_norm(want, (d,), norm.weight, norm.bias, LN_EPS)
        torch.testing.assert_close(out, ln, rtol=1e-5, atol=1e-5)


def test_off_cuda_the_plain_ops_run() -> None:
    x, a, y, w, norm = _inputs(4, 3, 16, torch.float32, seed=0)
    s, out = moe_norm.add_combine_layernorm(x, a, y, w, norm)
    want = x + a + combine_slots(y, w)
    assert torch.equal(s, want) and torch.equal(out, norm(want))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64])
def test_on_cuda_the_residual_is_the_two_kernels_bit_for_bit(n: int) -> None:
    x, a, y, w, norm = (t.cuda() for t in _inputs(n, 8, 2048, torch.bfloat16, seed=n))
    s, out = moe_norm.add_combine_layernorm(x, a, y, w, norm)
    m = moe_routing.combine_fused(y, w)
    s2, out2 = fused_norm.add_layernorm(x, a, m, norm)
    assert torch.equal(s, s2)
    torch.testing.assert_close(out, out2, rtol=0, atol=2**-6)  # one bf16 step at most


def test_the_decoders_expert_layers_hand_their_combine_to_the_next_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the fused expert path (interpreted kernels), every expert layer but the last
    gives its (outputs, weights) to the next block's norm, and the decoder answers as with
    the loop path."""
    from tests.support.interpreted import interpreted_moe
    from vlm_server.models.kv import DenseKVCache
    from vlm_server.models.moondream3 import moe, text
    from vlm_server.models.moondream3.moe import MoeMLP
    from vlm_server.models.registry import preset, random_model

    pytest.importorskip("triton")
    loaded = random_model(preset("md3-tiny"), seed=3, dtype=torch.float32, progress=False)
    decoder = loaded.model.text
    moe_layers = [b.mlp for b in decoder.blocks if isinstance(b.mlp, MoeMLP)]
    last_is_moe = isinstance(decoder.blocks[-1].mlp, MoeMLP)
    handed: list[int] = []

    def spy(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        handed.append(args[2].shape[0])
        return moe_norm.add_combine_layernorm(*args)

    monkeypatch.setattr(text, "add_combine_layernorm", spy)
    x = torch.randn(2, 5, decoder.cfg.dim)
    positions = torch.arange(5).repeat(2, 1)

    def run(method: str) -> torch.Tensor:
        for mlp in moe_layers:
            mlp.method = method
        kv = DenseKVCache(loaded.model.kv_shape, 16, 2, torch.float32, "cpu", prefix_len=0)
        with torch.no_grad():
            return decoder(x, positions, kv)

    want = run("loop")
    assert handed == []
    gen = interpreted_moe()
    kern = next(gen)
    try:
        monkeypatch.setattr(moe, "moe_triton", kern.triton)
        monkeypatch.setattr(moe, "moe_routing", kern.routing)
        got = run("fused")
    finally:
        gen.close()
    assert handed == [10] * (len(moe_layers) - last_is_moe)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
