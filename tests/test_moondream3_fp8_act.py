"""FP8 activations for Moondream 3's expert products (`experts_fp8_activations`): the row
quantizer and the grouped kernels' FP8 x FP8 path in Triton's interpreter against PyTorch
references of the same arithmetic, the switch's refusals, and the full-size path on the GPU
against the 16-bit path."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import interpreted
from vlm_server.models.moondream3 import act_quant, fp8_experts, moe, moe_triton
from vlm_server.models.moondream3.config import MoeConfig


@pytest.fixture(scope="module")
def kern() -> Iterator[SimpleNamespace]:
    pytest.importorskip("triton")  # (the interpreter's; the rest of the file needs none)
    from vlm_server.models.moondream3 import act_quant, moe_routing, moe_triton

    aq = interpreted(act_quant)
    mr = interpreted(moe_routing)
    mt = interpreted(moe_triton)
    mt.moe_routing = mr
    yield SimpleNamespace(quant=aq, routing=mr, triton=mt)
    for m in (aq, mr, mt):
        del sys.modules[m.__name__]


def _rows(seed: int) -> torch.Tensor:
    """Rows of very different ranges, one all zero, one with a single large value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 72, generator=gen)
    x *= torch.tensor([1.0, 40.0, 1e-3, 0.0, 3.0, 1.0])[:, None]
    x[5, 7] = 500.0
    return x


def _binade_carries(x: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Entries whose rounding to FP8 carries into the next power of two: Triton 3.6's
    interpreter converts those one binade low (a CPU emulation bug; GPUs convert in hardware)."""
    v = (x.float() / s[:, None]).abs()
    r = q.float().abs()
    return (r > v) & (torch.frexp(r).exponent > torch.frexp(v).exponent)


@pytest.mark.parametrize("seed", [0, 1])
def test_quant_rows_equals_the_reference(kern: SimpleNamespace, seed: int) -> None:
    x = _rows(seed)
    q, s = kern.quant.quant_rows(x)
    want_q, want_s = act_quant.quant_rows_reference(x)
    assert q.dtype == fp8_experts.FP8 and s.dtype == torch.float32
    assert torch.equal(s, want_s)
    assert s[3] == act_quant.MIN_SCALE and torch.all(q[3].float() == 0)
    assert want_q.float().abs().amax(dim=1)[[0, 1, 2, 4, 5]].eq(fp8_experts.FP8_MAX).all()
    same = q.float() == want_q.float()
    assert torch.all(same | _binade_carries(x, want_s, want_q))


def test_quant_rows_skips_rows_without_a_pair(kern: SimpleNamespace) -> None:
    x = _rows(2)
    pairs = torch.tensor([0, 9, 1, 9, 2, 3], dtype=torch.int32)  # 9: padding (n_pairs 4)
    _, s = kern.quant.quant_rows(x, pairs, 4)
    _, want_s = act_quant.quant_rows_reference(x)
    kept = pairs < 4
    assert torch.equal(s[kept], want_s[kept])


def _reference_quant(x, pairs=None, n_pairs=0):  # type: ignore[no-untyped-def]
    """`act_quant.quant_rows` in PyTorch (rows without a pair zero): isolates the grouped
    kernels from the interpreter's FP8 conversion."""
    if pairs is not None:  # (the kernel leaves them unwritten: any bits will do)
        x = x.masked_fill((pairs.long() >= n_pairs)[:, None], 0.0)
    return act_quant.quant_rows_reference(x)


def _fp8_act_reference(x, ids, q1, s1, q2, s2, hidden_dtype):  # type: ignore[no-untyped-def]
    """Each (token, expert) pair as the FP8-activation kernels compute it: x quantized per
    row, fc1 on the dequantized values, the activation, the row rounded to ``hidden_dtype``
    and quantized, fc2."""
    xq, xs = act_quant.quant_rows_reference(x)
    xd = xq.float() * xs[:, None]
    w1 = fp8_experts.dequantize(q1, s1, torch.float32)
    w2 = fp8_experts.dequantize(q2, s2, torch.float32)
    n, k = ids.shape
    out = torch.empty(n, k, w2.shape[1])
    for t in range(n):
        for j in range(k):
            e = int(ids[t, j])
            h = moe.expert_activation(F.linear(xd[t], w1[e])).to(hidden_dtype)
            hq, hs = act_quant.quant_rows_reference(h[None])
            out[t, j] = F.linear(hq.float()[0] * hs[0], w2[e])
    return out


@pytest.mark.parametrize("n, k, e", [(37, 3, 8), (64, 2, 5)])
def test_experts_fused_with_fp8_activations_equals_the_reference(
    kern: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, n: int, k: int, e: int
) -> None:
    mt = kern.triton
    monkeypatch.setattr(mt, "act_quant", SimpleNamespace(quant_rows=_reference_quant))
    d, i = 64, 32
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    ids[: n // 2] = torch.arange(k)  # uneven loads
    (q1, s1) = fp8_experts.quantize(torch.randn(e, 2 * i, d, generator=gen) / d**0.5)
    (q2, s2) = fp8_experts.quantize(torch.randn(e, d, i, generator=gen) / i**0.5)
    tiles = mt.ExpertTiles(16, mt.Tile(32, 32, 4, 2), mt.Tile(32, 32, 4, 2))
    got = mt.experts_fused(x, ids, q1, q2, s1, s2, tiles=tiles, fp8_act=True)
    want = _fp8_act_reference(x, ids, q1, s1, q2, s2, x.dtype)
    # fp32 sums in another order; a hidden value at an FP8 rounding tie may go either way
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # and the FP8 activations stay near the 16-bit-activation path
    plain = mt.experts_fused(x, ids, q1, q2, s1, s2, tiles=tiles)
    assert (got - plain).norm() / plain.norm() < 0.06


def test_fp8_activations_are_refused_without_fp8_weights_or_with_split_k(
    kern: SimpleNamespace,
) -> None:
    mt = kern.triton
    x, ids = torch.randn(4, 32), torch.zeros(4, 1, dtype=torch.long)
    w1, w2 = torch.randn(2, 32, 32), torch.randn(2, 32, 16)
    with pytest.raises(ValueError, match="FP8 activations need FP8 expert weights"):
        mt.experts_fused(x, ids, w1, w2, fp8_act=True)
    (q1, s1), (q2, s2) = fp8_experts.quantize(w1), fp8_experts.quantize(w2)
    split = mt.ExpertTiles(16, mt.Tile(32, 32, 4, 2, 2), mt.Tile(32, 32, 4, 2))
    with pytest.raises(ValueError, match="no split-K"):
        mt.experts_fused(x, ids, q1, q2, s1, s2, tiles=split, fp8_act=True)


def test_the_layer_takes_fp8_activations_only_for_wide_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`MoeMLP` asks for FP8 activations from FP8_ACT_MIN_TOKENS tokens, never with an
    adapter, and refuses the switch without FP8 weights."""
    mlp = moe.MoeMLP(32, MoeConfig(n_experts=4, top_k=2, expert_dim=16, start_layer=0))
    with pytest.raises(ValueError, match="need the experts' weights in FP8"):
        mlp.use_fp8_activations()
    mlp.fc1.use_fp8()
    mlp.fc2.use_fp8()
    mlp.use_fp8_activations()
    seen: list[tuple[int, bool, int]] = []

    def fake_fused(x, ids, w1, w2, s1, s2, delta, *, tiles, routing, fp8_act):  # type: ignore[no-untyped-def]
        seen.append((x.shape[0], fp8_act, tiles.bm))
        return torch.zeros(x.shape[0], ids.shape[1], x.shape[1])

    monkeypatch.setattr(moe_triton, "experts_fused", fake_fused)
    monkeypatch.setattr(moe.moe_routing, "route_align", _route_align_stub)
    monkeypatch.setattr(moe.moe_routing, "combine_fused", lambda y, w: y.sum(1))
    wide = moe_triton.FP8_ACT_MIN_TOKENS
    for n in (1, wide - 1, wide):
        mlp._fused(torch.randn(n, 32), None)
    mlp._fused(torch.randn(wide, 32), lambda *a: None)  # an adapter: 16-bit activations
    fp8_bm = moe_triton.FP8_ACT_TILES[-1][1].bm
    assert [(n, f) for n, f, _ in seen] == [
        (1, False),
        (wide - 1, False),
        (wide, True),
        (wide, False),
    ]
    assert seen[2][2] == fp8_bm


def _route_align_stub(logits, top_k, block_m):  # type: ignore[no-untyped-def]
    n = logits.shape[0]
    return torch.ones(n, top_k), torch.zeros(n, top_k, dtype=torch.long), None


def test_the_engine_switch_names_the_flag_for_a_model_without_experts() -> None:
    from vlm_server.engine.device.model_entry import ModelEntryPoints
    from vlm_server.models.registry import preset, random_model

    entry = ModelEntryPoints(random_model(preset("tiny"), dtype=torch.float32).model)
    with pytest.raises(ValueError, match=r"--experts-fp8-activations: the model 'tiny' has no FP8"):
        entry.use_fp8_expert_activations()


def test_the_engine_switch_names_the_flag_for_16_bit_experts() -> None:
    from vlm_server.engine.device.model_entry import ModelEntryPoints
    from vlm_server.models.registry import preset, random_model

    entry = ModelEntryPoints(random_model(preset("moondream3-tiny"), dtype=torch.float32).model)
    with pytest.raises(ValueError, match="experts_fp8_activations needs the experts in FP8"):
        entry.use_fp8_expert_activations()


@pytest.mark.parametrize(
    ("asked", "experts_fp8", "cuda", "on"),
    [
        (None, True, True, True),  # auto: FP8 experts on CUDA
        (None, False, True, False),  # auto: 16-bit experts
        (None, True, False, False),  # auto: the fused kernels are CUDA's
        (True, True, True, True),
        (False, True, True, False),  # asked off
        (True, False, False, True),  # asked: the model refuses it later, naming the flag
    ],
)
def test_auto_takes_fp8_activations_where_the_experts_are_fp8_on_cuda(
    asked: bool | None, experts_fp8: bool, cuda: bool, on: bool
) -> None:
    from vlm_server.engine.device.model_entry import fp8_activations_choice

    choice, why = fp8_activations_choice(asked, experts_fp8, cuda)
    assert choice is on
    assert why.startswith("auto") == (asked is None)


def test_the_entry_reads_whether_the_experts_are_held_in_fp8() -> None:
    from vlm_server.engine.device.model_entry import ModelEntryPoints
    from vlm_server.models.registry import preset, random_model

    tiny = ModelEntryPoints(random_model(preset("tiny"), dtype=torch.float32).model)
    assert tiny.wants_fp8_expert_activations(None)[0] is False  # no experts at all
    loaded = random_model(preset("moondream3-tiny"), dtype=torch.float32)
    md3 = ModelEntryPoints(loaded.model)
    assert loaded.model.experts_in_fp8 is False
    assert md3.wants_fp8_expert_activations(None) == (
        False,
        "auto: off, the experts are not in FP8",
    )
    loaded.model.use_fp8_experts()  # the CPU holds FP8 experts too (dequantized in the loop)
    assert loaded.model.experts_in_fp8 is True
    assert md3.wants_fp8_expert_activations(None) == (
        False,
        "auto: off, the fused FP8 kernels run on CUDA only",
    )
    assert md3.wants_fp8_expert_activations(True) == (True, "as asked")


# ---- the GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 730, 2920])
def test_full_size_fp8_activations_on_the_gpu(n: int) -> None:
    """md3's expert shapes (2048 wide, 64 experts of 1024, top-8) with FP8 weights: the row
    quantizer bit-exact, the layer near the 16-bit-activation path, and the compiled kernels
    against the reference of the same arithmetic."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not fp8_experts.fp8_experts_supported(torch.device("cuda")):
        pytest.skip("FP8 experts need compute capability 9.0+")
    torch.manual_seed(n)
    x = torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16)
    q, s = act_quant.quant_rows(x)
    want_q, want_s = act_quant.quant_rows_reference(x)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    mlp = moe.MoeMLP(2048, MoeConfig(n_experts=64, top_k=8, expert_dim=1024, start_layer=0))
    mlp = mlp.to("cuda", torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mlp.fc1.use_fp8()
    mlp.fc2.use_fp8()
    h = torch.randn(1, n, 2048, device="cuda", dtype=torch.bfloat16)
    plain = mlp(h).float()
    mlp.use_fp8_activations()
    got = mlp(h).float()
    assert torch.isfinite(got).all()
    assert (got - plain).norm() / plain.norm() < 0.05
    # the grouped kernels alone against the same arithmetic in PyTorch, a few tokens' worth
    ids = torch.stack([torch.randperm(64, device="cuda")[:8] for _ in range(n)])
    w1, w2 = mlp.fc1, mlp.fc2
    y = moe_triton.experts_fused(
        x, ids, w1.weight, w2.weight, w1.scale, w2.scale,
        tiles=moe_triton.FP8_ACT_TILES[-1][1], fp8_act=True,
    )  # fmt: skip
    pick = torch.arange(0, n, max(1, n // 16), device="cuda")
    want = _fp8_act_reference(
        x[pick].cpu(), ids[pick].cpu(), w1.weight.cpu(), w1.scale.cpu(), w2.weight.cpu(),
        w2.scale.cpu(), torch.bfloat16,
    )  # fmt: skip
    got_rows = y[pick].float().cpu()
    # fp32 sums in another order: a hidden value at an FP8 rounding tie may go the other way
    # (a few elements in 10^4 then differ by a step of that value's share)
    off = (got_rows - want).abs() > 3e-2 + 3e-2 * want.abs()
    assert off.float().mean() < 1e-4
    assert (got_rows - want).norm() / want.norm() < 1e-2
