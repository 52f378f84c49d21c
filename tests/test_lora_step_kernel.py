"""The decode step's grouped LoRA kernels against the per-slot ones (models/common/
lora_kernel.py) on the CPU through Triton's interpreter: lora_kernel's shrink that finishes its
own split sums, and models/common/lora_step.py's expand whose programs loop over the slots,
with GELU, summed deltas, shrinks over every slot's columns, uneven slots and rows without an
adapter; the norm that adds the deltas computed apart. fp32 (the interpreter's bf16 products
are not NumPy's). The compiled kernels run the decoder's GPU tests (test_adapters_gpu.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from tests.support.interpreted import interpreted

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kern() -> Iterator[SimpleNamespace]:
    from vlm_server.models.common import lora_kernel, lora_step

    mods = {m.__name__.rsplit(".", 1)[-1]: interpreted(m) for m in (lora_kernel, lora_step)}
    yield SimpleNamespace(**mods)
    for m in mods.values():
        del sys.modules[m.__name__]


# tokens, slots, rank, K, N1, N2
CASES = [
    (1, 1, 4, 40, 24, 56),
    (5, 3, 7, 300, 33, 17),
    (17, 4, 16, 520, 64, 130),
    (32, 8, 32, 1100, 96, 200),
    (64, 5, 12, 260, 48, 40),
]


def _index(t: int, slots: int, g: torch.Generator) -> torch.Tensor:
    """Uneven slots, some rows without an adapter, and slot 0 left out where there are
    several (a slot no row holds)."""
    low = 1 if slots > 2 else 0
    index = torch.randint(low - 1, slots, (t,), generator=g, dtype=torch.int32)
    index[0] = slots - 1
    return index


def _ordered(parts: torch.Tensor) -> torch.Tensor:
    """Split sums [T, splits, R] added in split order from zero, as the kernels add them."""
    v = torch.zeros_like(parts[:, 0])
    for s in range(parts.shape[1]):
        v = v + parts[:, s]
    return v[:, None]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_shrink_summing_its_splits_equals_the_splits_summed(
    kern: SimpleNamespace, case: int
) -> None:
    t, slots, r, k, _, _ = CASES[case]
    g = torch.Generator().manual_seed(case)
    x = torch.randn(t, k, generator=g)
    a = torch.randn(slots, r + 3, k, generator=g)[:, 1 : r + 1]  # strided like a bank's group
    index = _index(t, slots, g)
    count = torch.zeros(slots + 2, dtype=torch.int32)
    got = kern.lora_kernel.shrink(x, a, index, count)
    want = _ordered(kern.lora_kernel.shrink(x, a, index).parts)
    rows = index >= 0
    assert got.splits == 1
    assert torch.equal(got.parts[rows], want[rows])
    assert torch.equal(count, torch.zeros_like(count))  # left ready for the next launch
    again = kern.lora_kernel.shrink(x, a, index, count)
    assert torch.equal(again.parts[rows], got.parts[rows])


def _targets(kern: SimpleNamespace, case: int, riding: bool, same_out: bool):
    t, slots, r, _, n1, n2 = CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    index = _index(t, slots, g)
    lk = kern.lora_kernel
    if riding:  # every slot's columns for every token (a shrink riding a product)
        cols = 3 * r
        sums = torch.randn(t, 1, slots * cols, generator=g)
        first = lk.Partials(sums, cols)
        second, col1, col2 = first, 0, 2 * r
    else:
        first = lk.Partials(torch.randn(t, 1, 16 * ((r + 15) // 16), generator=g))
        second = lk.Partials(torch.randn(t, 1, 16 * ((r + 15) // 16), generator=g))
        col1 = col2 = 0
    b1 = torch.randn(slots, 2, n1, r, generator=g)[:, 1]
    out1 = torch.randn(t, n1 + 5, generator=g)[:, 2 : 2 + n1]  # a column slice of a product
    if same_out:
        b2 = torch.randn(slots, n1, r, generator=g)
        out2 = out1
    else:
        b2 = torch.randn(slots, n2, r, generator=g)
        out2 = torch.randn(t, n2, generator=g)
    return index, (first, col1, b1, out1), (second, col2, b2, out2)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(
    "form", ["gelu-riding", "gelu", "two-riding", "sum-riding", "sum", "one-riding"]
)
def test_the_step_expand_equals_the_per_slot_expand(
    kern: SimpleNamespace, case: int, form: str
) -> None:
    riding = form.endswith("riding")
    same_out = form.startswith("sum")
    index, one, two = _targets(kern, case, riding, same_out)
    results = []
    for module in (kern.lora_kernel, kern.lora_step):
        outs = [one[3].clone(), two[3].clone()]
        if same_out:
            outs[1] = outs[0]
        first = module.Target(one[0], one[1], one[2], outs[0])
        second = module.Target(two[0], two[1], two[2], outs[1])
        if form.startswith("one"):
            module.expand(index, first)
        else:
            module.expand(index, first, second, gelu=form.startswith("gelu"), same_out=same_out)
        results.append(outs)
    (want1, want2), (got1, got2) = results
    # Rows without an adapter: untouched, or the GELU alone, exactly. Rows with one: the same
    # sums of products, but NumPy's matrix products (and a GPU's instructions) may order a
    # product's terms by its tile's width: the last bit may differ.
    bare = index < 0
    assert torch.equal(got1[bare], want1[bare]) and torch.equal(got2[bare], want2[bare])
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want1[~bare], one[3][~bare])  # the deltas went in


def test_fits_takes_one_block_of_tokens_and_one_split(kern: SimpleNamespace) -> None:
    lk, step = kern.lora_kernel, kern.lora_step
    one = lk.Partials(torch.zeros(4, 1, 16))
    assert step.fits(64, one) and step.fits(1, one, one)
    assert not step.fits(65, one)
    assert not step.fits(0)
    assert not step.fits(8, lk.Partials(torch.zeros(4, 3, 16)))


def test_the_norm_adds_the_deltas_after_the_split_sums() -> None:
    """`add_partials_layernorm`'s ``extra`` (the adapters' deltas computed beside the branch
    product): the split sums, the bias, then the extra term, as PyTorch adds them."""
    from vlm_server.models.common import fused_norm
    from vlm_server.models.common.layers import LayerNorm

    norm_mod = interpreted(fused_norm)
    try:
        g = torch.Generator().manual_seed(3)
        rows, dim = 5, 48
        x = torch.randn(rows, dim, generator=g)
        parts = torch.randn(3, rows, dim, generator=g)
        bias = torch.randn(dim, generator=g)
        extra = torch.randn(rows, dim, generator=g)
        norm = LayerNorm(dim)
        with torch.no_grad():
            norm.weight.normal_(generator=g)
            norm.bias.normal_(generator=g)
            s, out = norm_mod.add_partials_layernorm(x, parts, bias, norm, extra)
            branch = bias + parts[0] + parts[1] + parts[2] + extra
            torch.testing.assert_close(s, x + branch, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(out, norm(x + branch), rtol=1e-5, atol=1e-5)
            s0, _ = norm_mod.add_partials_layernorm(x, parts, bias, norm)
            assert not torch.allclose(s0, s)
    finally:
        del sys.modules[norm_mod.__name__]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_step_expand_takes_a_gelu_output_alone(kern: SimpleNamespace, case: int) -> None:
    """fc1's delta and its GELU in a launch of their own (qkv's went first, for the
    attention): the per-slot expand's delta, then the GELU of every row."""
    index, one, _ = _targets(kern, case, True, False)
    want, got = one[3].clone(), one[3].clone()
    kern.lora_kernel.expand(index, kern.lora_kernel.Target(one[0], one[1], one[2], want))
    u = want.double()
    want = u / (1 + torch.exp(torch.clamp(-2 * 0.7978845608028654 * (u + 0.044715 * u**3), max=80)))
    kern.lora_step.expand(index, kern.lora_step.Target(one[0], one[1], one[2], got), gelu=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
