"""Moondream 3's one-launch tau scaling (models/moondream3/tau_kernel.py) on the CPU through
Triton's interpreter, against `Tau.scale`'s PyTorch ops: both GELUs and both position modes,
grouped value heads, a head width that is not a power of two, token counts that do not fill a
block, keys passed through bit for bit."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.support.interpreted import interpreted
from vlm_server.models.moondream3.config import TextConfig
from vlm_server.models.moondream3.tau import Tau

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kern() -> Iterator[ModuleType]:
    from vlm_server.models.moondream3 import tau_kernel

    mod = interpreted(tau_kernel)
    yield mod
    del sys.modules[mod.__name__]


def _tau(heads: int, kv_heads: int, hd: int, gelu: str, positions: str, seed: int) -> Tau:
    cfg = TextConfig(dim=heads * hd, n_heads=heads, n_kv_heads=kv_heads, rotary_dim=8)
    tau = Tau(cfg, gelu, positions)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    for p in (tau.wq, tau.wv):
        p.data = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5 * 4
    tau.alpha.data = torch.randn(tau.alpha.shape, generator=gen)
    return tau.requires_grad_(False)


def _run(kern: ModuleType, tau: Tau, qkv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    w = torch.cat([tau.wq, tau.wv]).to(qkv.dtype).contiguous()
    return kern.tau_scale(
        qkv, pos, w, tau.alpha, tau.wq.shape[0], tau.wv.shape[0],
        tau.approximate == "none", tau.bf16_positions,
    )  # fmt: skip


CASES = [  # heads, kv heads, head width, batch, tokens
    (4, 4, 16, 1, 1),
    (8, 4, 24, 2, 19),
    (20, 20, 8, 1, 37),
    (4, 2, 8, 1, 70),  # a prefill's wider blocks of tokens, every head in one block
    (24, 12, 8, 1, 70),  # ... of 36 heads
]


# The widest cases take a second or more each under the interpreter: the suite runs each
# with one GELU and positions pair, the other pairs with --run-slow.
_WIDE = {(20, 20, 8, 1, 37): ("tanh", "bf16"), (24, 12, 8, 1, 70): ("erf", "fp32")}
_TAU_CASES = [
    pytest.param(
        *case,
        gelu,
        positions,
        marks=pytest.mark.slow if case in _WIDE and _WIDE[case] != (gelu, positions) else (),
    )
    for case in CASES
    for gelu in ("tanh", "erf")
    for positions in ("fp32", "bf16")
]


@pytest.mark.parametrize(("heads", "kv_heads", "hd", "b", "t", "gelu", "positions"), _TAU_CASES)
def test_fused_tau_equals_the_pytorch_ops_in_fp32(
    kern: ModuleType, heads: int, kv_heads: int, hd: int, b: int, t: int, gelu: str,
    positions: str,
) -> None:  # fmt: skip
    tau = _tau(heads, kv_heads, hd, gelu, positions, seed=heads + t)
    gen = torch.Generator().manual_seed(t)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * hd, generator=gen) * 2
    # Positions as the engine's decode step passes them: a column of a wider table (strided).
    table = torch.randint(0, 5000, (b * t, 3), generator=gen)
    table[0, 1] = 0
    pos = table[:, 1:2].view(b, t)
    got = _run(kern, tau, qkv, pos)
    want = tau.scale(qkv, pos, heads)
    k0, k1 = heads * hd, (heads + kv_heads) * hd
    assert torch.equal(got[..., k0:k1], qkv[..., k0:k1])  # keys pass through
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    # The scales are not trivially one: the kernel really scaled the query and value heads.
    assert not torch.allclose(got[..., :k0], qkv[..., :k0], rtol=1e-2, atol=1e-2)
    assert not torch.allclose(got[..., k1:], qkv[..., k1:], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("positions", ["fp32", "bf16"])
def test_fused_tau_rounds_like_the_pytorch_ops_in_bf16(kern: ModuleType, positions: str) -> None:
    heads, kv_heads, hd = 8, 4, 16
    tau = _tau(heads, kv_heads, hd, "tanh", positions, seed=3).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(2, 21, (heads + 2 * kv_heads) * hd, generator=gen) * 2).bfloat16()
    pos = torch.tensor([list(range(700, 721)), list(range(21))])
    got = _run(kern, tau, qkv, pos).float()
    want = tau.scale(qkv, pos, heads).float()
    # Equal but for the products' summation order and the last fp32 bits of exp/tanh: a
    # rounding boundary moves a value by one bf16 step at most, rarely.
    step = want.abs().clamp_min(1e-30) * 2**-7
    assert ((got - want).abs() <= step).all()
    assert (got != want).float().mean() < 0.02


def test_a_tokens_result_is_the_same_at_every_batch_size_of_its_side(kern: ModuleType) -> None:
    """Splits depend on the side of DECODE_M only: a token's bits do not depend on how many
    other tokens share its step (an image prefix alone or batched), on either side."""
    heads, kv_heads, hd = 24, 12, 8
    tau = _tau(heads, kv_heads, hd, "erf", "fp32", seed=11).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    qkv = (torch.randn(1, 150, (heads + 2 * kv_heads) * hd, generator=gen) * 2).bfloat16()
    pos = torch.arange(150)[None]
    for lo, hi in ((0, kern.DECODE_M), (kern.DECODE_M + 1, 150)):
        full = _run(kern, tau, qkv[:, :hi], pos[:, :hi])
        alone = _run(kern, tau, qkv[:, : max(lo, 1)], pos[:, : max(lo, 1)])
        assert torch.equal(full[:, : max(lo, 1)], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 32, 730, 2920])
def test_fused_tau_on_the_gpu_at_full_size(positions: str, tokens: int) -> None:
    """The compiled kernel at Moondream 3's shapes (32 + 32 heads of 64) in bf16, through
    `Tau.use_kernel`, against the PyTorch ops on the same device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tau = _tau(32, 32, 64, "tanh", positions, seed=7).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(1, tokens, 96 * 64, generator=gen, device="cuda").bfloat16() * 2
    pos = torch.arange(tokens, device="cuda")[None] + 3
    want = tau.scale(qkv, pos, 32).float()
    assert tau.use_kernel(True)
    got = tau.scale(qkv, pos, 32).float()
    # The GPU's exp and log are not PyTorch's to the last fp32 bit: a tau at a bf16 rounding
    # boundary may land one step over (then its whole head, rounded once more). A step of a
    # tau near 1 is 2^-7 of the unscaled value: relative to the result it is large where tanh
    # and the position term cancel (tau near 0).
    step = torch.maximum(want.abs(), qkv.float().abs()) * 2**-6
    assert ((got - want).abs() <= step).all()
    assert (got != want).float().mean() < 0.05
    assert torch.equal(got[..., 2048:4096], qkv[..., 2048:4096].float())
