"""Counter-based batched sampling and device-side masking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.batch_masks import (
    apply_masks,
    fill_row_indices,
    table_tensor,
)
from decoding.mask_table import NO_MASK, MaskTable
from decoding.sampling import _mul32, row_keys, row_uniforms, sample
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)


def _rows(b: int, temperature: float = 1.0, top_p: float = 1.0) -> tuple[torch.Tensor, ...]:
    return torch.full((b,), temperature), torch.full((b,), top_p)


def test_mul32_has_no_overflow_and_is_exact() -> None:
    x = torch.randint(0, 2**32, (5000,), dtype=torch.int64)
    x[:3] = torch.tensor([0, 1, 2**32 - 1])
    for c in (0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9, 0xFFFFFFFF):
        expected = torch.tensor([(int(v) * c) % 2**32 for v in x])
        assert torch.equal(_mul32(x, c), expected)


def test_uniforms_are_open_interval_and_roughly_uniform() -> None:
    n = 80000
    u = row_uniforms(torch.full((n,), 5), torch.arange(n))
    assert u.dtype == torch.float32
    assert float(u.min()) > 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert float(hist.min()) > 0.95 * n / 10 and float(hist.max()) < 1.05 * n / 10
    # Neighbouring seeds are not correlated either.
    v = row_uniforms(torch.arange(n), torch.full((n,), 5))
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.02


def test_row_keys_depend_on_all_bits_of_seed_and_step() -> None:
    base = row_keys(torch.tensor([123]), torch.tensor([7]))
    for seed, step in [(123 + 2**40, 7), (-123, 7), (123, 7 + 2**33), (124, 7), (123, 8)]:
        assert not torch.equal(row_keys(torch.tensor([seed]), torch.tensor([step])), base)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**62), st.integers(0, 10_000), st.integers(2, 64))
def test_row_result_ignores_batch_composition(seed: int, step: int, batch: int) -> None:
    gen = torch.Generator().manual_seed(seed % 2**31)
    vocab = 300
    row = torch.randn(1, vocab, generator=gen) * 3
    temperature, top_p = torch.tensor([0.8]), torch.tensor([0.9])
    alone = sample(row, temperature, top_p, torch.tensor([seed]), torch.tensor([step]))
    logits = torch.randn(batch, vocab, generator=gen) * 3
    pos = int(torch.randint(0, batch, (1,), generator=gen))
    logits[pos] = row[0]
    temps = torch.rand(batch, generator=gen)
    temps[pos] = 0.8
    tops = torch.rand(batch, generator=gen)
    tops[pos] = 0.9
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    seeds[pos] = seed
    steps = torch.randint(0, 10_000, (batch,), generator=gen)
    steps[pos] = step
    together = sample(logits, temps, tops, seeds, steps)
    assert int(together[pos]) == int(alone[0])


def test_reproducible_and_seed_sensitive() -> None:
    logits = torch.randn(16, 500)
    t, p = _rows(16)
    seeds, steps = torch.arange(16), torch.zeros(16, dtype=torch.int64)
    a = sample(logits, t, p, seeds, steps)
    assert torch.equal(a, sample(logits.clone(), t, p, seeds, steps))
    draws = {tuple(sample(logits, t, p, seeds + k, steps).tolist()) for k in range(5)}
    assert len(draws) > 1


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(32, 1000)
    t, p = _rows(32, temperature=0.0, top_p=0.1)
    ids = sample(logits, t, p, torch.arange(32), torch.arange(32))
    assert torch.equal(ids, logits.argmax(dim=-1))


def _reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    p = torch.softmax(logits / temperature, dim=-1).double()
    sorted_p, order = p.sort(descending=True, stable=True)
    keep = (sorted_p.cumsum(0) - sorted_p) <= top_p
    keep[0] = True
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(p)
    out[order] = sorted_p / sorted_p.sum()
    return out.numpy()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (1.5, 0.5)])
def test_distribution_matches_top_p_softmax(temperature: float, top_p: float) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, float("-inf")])
    n = 6000
    batch = logits.expand(n, -1)
    t, p = _rows(n, temperature, top_p)
    ids = sample(batch, t, p, torch.full((n,), 2024), torch.arange(n))
    counts = np.bincount(ids.numpy(), minlength=logits.numel())
    expected = _reference_probs(logits, temperature, top_p) * n
    assert counts[expected == 0].sum() == 0  # masked and truncated tokens never drawn
    support = expected > 0
    chi2 = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    dof = int(support.sum()) - 1
    # Far beyond the 99.9% quantile for these degrees of freedom (<= 6): 22.5.
    assert chi2 < 30, (chi2, dof, counts, expected)


def test_masked_tokens_never_drawn() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 200, generator=gen) * 5
    allowed = torch.rand(64, 200, generator=gen) < 0.1
    allowed[:, 0] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    for step in range(20):
        t = torch.rand(64, generator=gen) * 2
        p = torch.rand(64, generator=gen)
        ids = sample(masked, t, p, torch.arange(64), torch.full((64,), step))
        assert allowed[torch.arange(64), ids].all()


def test_all_but_one_masked() -> None:
    logits = torch.full((4, 50), float("-inf"))
    logits[torch.arange(4), torch.tensor([3, 17, 49, 0])] = torch.tensor([-100.0, 0.0, 1e4, 5.0])
    for temperature, top_p in [(0.0, 1.0), (1.0, 1.0), (0.3, 0.01), (2.0, 0.0)]:
        t, p = _rows(4, temperature, top_p)
        ids = sample(logits, t, p, torch.arange(4), torch.zeros(4, dtype=torch.int64))
        assert ids.tolist() == [3, 17, 49, 0]


def test_top_p_zero_keeps_only_the_top_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]]).expand(200, -1)
    t, p = _rows(200, 1.0, 0.0)
    ids = sample(logits, t, p, torch.arange(200), torch.zeros(200, dtype=torch.int64))
    assert set(ids.tolist()) == {1}


# ---------------------------------------------------------------- masks on the device


def test_apply_masks_sets_disallowed_to_minus_inf_and_keeps_no_mask_rows() -> None:
    width = 40
    table = MaskTable(width)
    only = table.allow_only([1, 5, 7])
    but = table.allow_all_but([0, 39])
    device_table = table_tensor(table)
    assert device_table.dtype == torch.bool and device_table.shape == (3, width)
    logits = torch.randn(3, width)
    rows = torch.tensor([NO_MASK, only, but], dtype=torch.int32)
    out = apply_masks(logits, rows, device_table)
    assert torch.equal(out[0], logits[0])  # NO_MASK: untouched bit for bit
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [1, 5, 7]
    assert torch.equal(out[1, [1, 5, 7]], logits[1, [1, 5, 7]])
    assert torch.isinf(out[2, [0, 39]]).all() and torch.isfinite(out[2, 1:39]).all()
    assert torch.equal(logits, logits.clone())  # input not modified


def test_fill_row_indices_counts_constrained_rows() -> None:
    class G:
        def __init__(self, row: int) -> None:
            self.mask_row = row

    out = np.full(8, -1, dtype=np.int32)
    n = fill_row_indices([G(0), None, G(4), G(2)], out)
    assert n == 2
    assert out[:4].tolist() == [0, NO_MASK, 4, 2] and out[4:].tolist() == [-1] * 4


# ---------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_without_host_sync() -> None:
    gen = torch.Generator().manual_seed(7)
    b, width = 64, 51200
    table = MaskTable(width)
    rows = [table.allow_only(torch.randint(0, width, (50,), generator=gen).tolist())]
    rows.append(table.allow_all_but(range(0, width, 3)))
    logits = torch.randn(b, width, generator=gen) * 3
    index = torch.tensor([rows[k % 2] if k % 3 else NO_MASK for k in range(b)], dtype=torch.int32)
    temperature = torch.rand(b, generator=gen)
    temperature[::4] = 0.0
    top_p = torch.rand(b, generator=gen)
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=gen)
    steps = torch.randint(0, 2**40, (b,), generator=gen)
    args = (temperature, top_p, seeds, steps)

    cpu = sample(apply_masks(logits, index, table_tensor(table)), *args)
    dev = [t.cuda() for t in (logits, index, *args)]
    device_table = table_tensor(table, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        masked = apply_masks(dev[0], dev[1], device_table)
        ids = sample(masked, *dev[2:])
        keys = row_keys(dev[4], dev[5])
        u = row_uniforms(dev[4], dev[5])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # The hash is integer math: bit-identical. Draws agree unless float rounding of the
    # softmax differs between devices at a near-tie (rare).
    assert torch.equal(keys.cpu(), row_keys(seeds, steps))
    assert torch.equal(u.cpu(), row_uniforms(seeds, steps))
    assert (ids.cpu() == cpu).float().mean() >= 0.95
    assert torch.equal(
        ids.cpu()[::4],
        logits.masked_fill(~table_tensor(table)[index.long()], float("-inf")).argmax(-1)[::4],
    )
