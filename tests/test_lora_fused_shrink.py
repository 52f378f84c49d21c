"""The LoRA shrink riding the fused decode products, on the CPU through Triton's interpreter:
the skinny product's extra columns (every slot's A times the input, or its tail) against
PyTorch over random shapes, launch shapes and strided A's, the product's own columns bit for
bit unchanged; the expand reading each token's slot's columns; and the decoder's fused
few-row forward with the folded shrinks against the reference row by row and against the
separate-shrink path (rows without an adapter bit for bit)."""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from tests.support.interpreted import interpreted
from vlm_server.models.common import fused_products
from vlm_server.models.interface import LoadedModel
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.lora import files
from vlm_server.models.lora import products as lora_products
from vlm_server.models.lora.bank import LoraBank, LoraBatch
from vlm_server.models.lora.spec import SingleLora
from vlm_server.models.lora.writer import random_state

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kern() -> Iterator[SimpleNamespace]:
    from vlm_server.models.common import fused_norm, lora_kernel, lora_step, skinny_gemm

    mods = {
        m.__name__.rsplit(".", 1)[-1]: interpreted(m) for m in (skinny_gemm, lora_kernel, lora_step)
    }
    mods["fused_norm"] = interpreted(fused_norm)
    yield SimpleNamespace(**mods)
    for m in mods.values():
        del sys.modules[m.__name__]


CASES = [
    # rows, n, k1, k2, slots, rank rows per slot, shrink over the tail only, block_n, block_k, split
    (1, 40, 48, 0, 3, 5, False, 16, 32, 1),
    (5, 24, 32, 80, 2, 7, True, 16, 32, 3),
    (17, 33, 40, 64, 4, 3, False, 32, 32, 2),
    (32, 64, 64, 96, 5, 12, True, 32, 64, 4),
    (9, 130, 100, 0, 1, 16, False, 64, 32, 1),
    (2, 16, 16, 200, 6, 4, True, 16, 64, 2),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("partials", [False, True])
def test_the_shrink_riding_the_product_equals_torch(
    kern: SimpleNamespace, case: int, partials: bool
) -> None:
    m, n, k1, k2, slots, rs, tail, bn, bk, split = CASES[case]
    g = torch.Generator().manual_seed(case)
    sg = kern.skinny_gemm
    cfg = sg.SkinnyConfig(bn, bk, 4, 1, split)
    x1 = torch.randn(m, k1, generator=g)
    x2 = torch.randn(m, k2, generator=g) if k2 else None
    w = torch.randn(n, k1 + k2, generator=g)
    b = torch.randn(n, generator=g)
    k_a = k2 if tail else k1 + k2
    # One layer's rows of a bank-like buffer: slot and row strides of their own.
    bank = torch.randn(slots, 3, rs + 2, k_a, generator=g)
    a = bank[:, 1, 1 : rs + 1]
    y, sums = sg.skinny_linear_shrink(x1, w, b, a, x2=x2, config=cfg, partials=partials)
    plain = sg.skinny_linear(x1, w, b, x2=x2, config=cfg, partials=partials)
    assert torch.equal(y, plain)  # the product's own columns: the same sums, bit for bit
    assert sums.dtype == torch.float32 and sums.shape == (split, m, slots * rs)
    x = x1 if x2 is None else torch.cat([x1, x2], 1)
    want = torch.einsum("mk,srk->msr", x[:, -k_a:].double(), a.double()).reshape(m, -1)
    torch.testing.assert_close(sums.double().sum(0), want, atol=1e-4, rtol=1e-4)


def test_the_shrink_rejects_weights_that_do_not_fit(kern: SimpleNamespace) -> None:
    sg = kern.skinny_gemm
    x, w = torch.randn(2, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="shrink weights"):
        sg.skinny_linear_shrink(x, w, None, torch.randn(2, 4, 9))


def _uneven(g: torch.Generator, t: int, slots: int) -> torch.Tensor:
    weights = torch.tensor([0.25] + [0.75 / slots] * slots)
    return torch.multinomial(weights, t, replacement=True, generator=g).to(torch.int32) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_the_expand_reads_each_tokens_slot_columns(
    kern: SimpleNamespace, dtype: torch.dtype, seed: int
) -> None:
    """Expands over every slot's shrink (a product's extra columns) equal those over the
    grouped shrink's partials: two outputs with the GELU, and two deltas into one sum."""
    lk, sg = kern.lora_kernel, kern.skinny_gemm
    g = torch.Generator().manual_seed(seed)
    t, d, f, slots, r = [(5, 32, 64, 2, 4), (21, 48, 96, 5, 8), (32, 64, 128, 3, 16)][seed]
    a_in = (torch.randn(slots, 3 * r, d, generator=g) * 0.2).to(dtype)
    a_fc2 = (torch.randn(slots, r, f, generator=g) * 0.2).to(dtype)
    bs = {n: (torch.randn(slots, w, r, generator=g) * 0.2).to(dtype) for n, w in
          [("qkv", 3 * d), ("fc1", f), ("proj", d), ("fc2", d)]}  # fmt: skip
    h = torch.randn(t, d, generator=g).to(dtype)
    hidden = torch.randn(t, f, generator=g).to(dtype)
    index = _uneven(g, t, slots)
    cfg = sg.SkinnyConfig(16, 32, 4, 1, 2)
    w_in, w_out = torch.randn(4 * d, d).to(dtype), torch.randn(d, d + f).to(dtype)
    _, in_sums = sg.skinny_linear_shrink(h, w_in, None, a_in, config=cfg, partials=True)
    _, fc2_sums = sg.skinny_linear_shrink(
        h, w_out, None, a_fc2, x2=hidden, config=cfg, partials=True
    )
    folded = (
        lk.Partials(in_sums.permute(1, 0, 2), 3 * r),
        lk.Partials(fc2_sums.permute(1, 0, 2), r),
    )
    grouped = (lk.shrink(h, a_in, index), lk.shrink(hidden, a_fc2, index))
    base = {n: torch.randn(t, b.shape[1], generator=g).to(dtype) for n, b in bs.items()}
    results = []
    for p_in, p_fc2 in (grouped, folded):
        o = {n: v.clone() for n, v in base.items()}
        lk.expand(
            index, lk.Target(p_in, 0, bs["qkv"], o["qkv"]),
            lk.Target(p_in, 2 * r, bs["fc1"], o["fc1"]), gelu=True,
        )  # fmt: skip
        lk.expand(
            index, lk.Target(p_in, r, bs["proj"], o["proj"]),
            lk.Target(p_fc2, 0, bs["fc2"], o["proj"]), same_out=True,
        )  # fmt: skip
        results.append(o)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    none = index < 0
    for name in ("qkv", "fc1", "proj"):
        want, got = results[0][name], results[1][name]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert torch.equal(got[none], want[none])
    assert torch.equal(results[1]["qkv"][none], base["qkv"][none])
    assert torch.equal(results[1]["proj"][none], base["proj"][none])
    used = ~none
    assert not torch.equal(results[1]["proj"][used], base["proj"][used])  # deltas were added


def _fused_text(tiny: LoadedModel) -> torch.nn.Module:
    """A copy of the tiny decoder with its products stacked (on the CPU, which
    `use_fused_products` leaves off)."""
    text = copy.deepcopy(tiny.model.text)
    text._stacked = [
        fused_products.stack_block(b.attn.qkv, b.mlp.fc1, b.attn.proj, b.mlp.fc2)
        for b in text.blocks
    ]
    return text


@pytest.mark.parametrize(
    ("fc2_shrink", "step"),
    [("expand", False), ("branch", False), ("apart", False), ("apart", True)],
)
def test_the_fused_forward_with_folded_shrinks_equals_the_reference_per_row(
    tiny: LoadedModel,
    kern: SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    fc2_shrink: str,
    step: bool,
) -> None:
    """One decode position per row, two adapters and none, through `_fused_forward` with the
    interpreted kernels, fc2's shrink in the expand, the branch product or apart (``step``:
    with the decode step's kernels, the products unsplit as moondream2's wide first product
    is, so that every expand takes them): the reference (`SingleLora`, the plain forward) row
    by row; the separate-shrink path to rounding, its rows without an adapter bit for bit;
    those rows as the forward without adapters computes them, to rounding."""
    if step:
        unsplit = kern.skinny_gemm.default_config

        def one_split(*args: object) -> object:
            return dataclasses.replace(unsplit(*args), split_k=1)

        monkeypatch.setattr(kern.skinny_gemm, "default_config", one_split)
    monkeypatch.setattr(fused_products, "skinny_gemm", kern.skinny_gemm)
    monkeypatch.setattr(
        fused_products, "add_partials_layernorm", kern.fused_norm.add_partials_layernorm
    )
    monkeypatch.setattr(lora_products, "FC2_SHRINK", fc2_shrink)
    text = _fused_text(tiny)
    cfg = text.cfg
    targets = text.lora_targets
    bank = LoraBank(targets, 3, 4, torch.float32, "cpu")
    adapters = []
    for slot, rank in [(0, 4), (2, 2)]:  # slot 1 stays empty: its columns go unread
        state = {files.rename(k): v for k, v in random_state(targets, rank, 30 + slot).items()}
        w = files.validate(state, targets, 4, f"a{slot}")
        bank.write(slot, bank.staging(w), w.rank)
        adapters.append((slot, w))
    by_slot = dict(adapters)
    rows = [2, -1, 0, 2, -1, 0]
    b = len(rows)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, 1, cfg.dim, generator=g)
    pos = torch.randint(0, 6, (b, 1), generator=g)
    index = torch.tensor(rows, dtype=torch.int32)

    def cache(batch: int) -> DenseKVCache:
        return DenseKVCache(tiny.model.kv_shape, 16, batch, torch.float32, "cpu", prefix_len=0)

    def fused(lora: LoraBatch | None) -> torch.Tensor:
        kv = cache(b)
        cos, sin = text.rope_cos[pos], text.rope_sin[pos]

        def attend(layer: int, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            q, k, v = text.blocks[layer].attn.split_qkv(qkv, cos, sin)
            return kv.attend(layer, q, k, v, positions)

        return text._fused_forward(x, pos, attend, lora)

    calls: list[str] = []
    lk, sg = kern.lora_kernel, kern.skinny_gemm

    def counted(module: object, name: str) -> None:
        real = getattr(module, name)

        def call(*args: object, **kwargs: object) -> object:
            calls.append(name if kwargs.get("shrink_after") is None else "expand_then_shrink")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for module, name in [(sg, "skinny_linear_shrink"), (lk, "shrink"), (lk, "expand")]:
        counted(module, name)
    ls = kern.lora_step
    for name in ("expand",):
        real_step = getattr(ls, name)

        def step_call(
            *args: object, _real: object = real_step, _name: str = name, **kwargs: object
        ) -> object:
            calls.append(f"step {_name}")
            return _real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(ls, name, step_call)
    n = cfg.n_layers
    with torch.no_grad():
        got = fused(LoraBatch(bank, index, kernels=lk, step=ls if step else None))
        # Per block: the product with the shared shrink, and fc2's shrink where FC2_SHRINK
        # puts it; then two expands.
        want_calls = {
            "expand": {"skinny_linear_shrink": n, "expand_then_shrink": n, "expand": n},
            "branch": {"skinny_linear_shrink": 2 * n, "expand": 2 * n},
            "apart": {"skinny_linear_shrink": n, "shrink": n, "expand": 2 * n},
        }[fc2_shrink]
        if step:
            # qkv's expand, then fc1's with its GELU (apart: on a second stream on CUDA),
            # fc2's shrink, proj's and fc2's expand into the branch.
            want_calls = {"skinny_linear_shrink": n, "shrink": n, "step expand": 3 * n}
        assert {c: calls.count(c) for c in set(calls)} == want_calls
        with monkeypatch.context() as mp:
            mp.setattr(LoraBatch, "shrink_weights", lambda *_: None)
            mp.setattr(lora_products, "FC2_SHRINK", "apart")
            separate = fused(LoraBatch(bank, index, kernels=lk))
        plain = fused(None)
        for i, slot in enumerate(rows):
            args = (x[i : i + 1], pos[i : i + 1], cache(1))
            want = text(*args) if slot < 0 else text(*args, SingleLora(by_slot[slot]))
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)
    none = index < 0
    assert torch.equal(got[none], separate[none])
    # Without adapters fc1's GELU is the product's epilogue and the branch's sum finishes in
    # the norm: other arithmetic, equal to rounding only.
    torch.testing.assert_close(got[none], plain[none], atol=1e-5, rtol=1e-5)


def test_a_bank_of_many_high_rank_slots_keeps_the_grouped_shrink() -> None:
    """At moondream2's widths 8 slots of rank 32 ride both products; 64 slots of rank 64
    would add most of either product's bytes again, so they do not."""
    d, ff = 2048, 8192
    w_in = torch.empty(3 * d + ff, d, device="meta")
    w_out = torch.empty(d, d + ff, device="meta")
    for slots, r, folds in [(8, 32, True), (64, 64, False)]:
        a_in = torch.empty(slots, 3 * r, d, device="meta")
        a_fc2 = torch.empty(slots, r, ff, device="meta")
        assert lora_products.worth_folding(a_in, w_in) is folds
        assert lora_products.worth_folding(a_fc2, w_out) is folds


@pytest.mark.parametrize("rows", [1, 6])
def test_the_branch_split_beside_the_attention_equals_the_one_product(
    tiny: LoadedModel, kern: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """`_fused_forward` without adapters, fc2's share of the branch started before the
    attention and proj's after it (`fused_products.PARALLEL_BRANCH`; no side stream on the
    CPU), and the whole MLP forked off before QKV (`EARLY_MLP_MAX_ROWS`), against the branch
    as one product over [attention | hidden]: equal to rounding; fc2's split sums land in
    the buffer given, and the forked MLP's equal gelu(fc1) times fc2."""
    monkeypatch.setattr(fused_products, "skinny_gemm", kern.skinny_gemm)
    monkeypatch.setattr(
        fused_products, "add_partials_layernorm", kern.fused_norm.add_partials_layernorm
    )
    text = _fused_text(tiny)
    cfg = text.cfg
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, cfg.dim, generator=g)
    pos = torch.randint(0, 6, (rows, 1), generator=g)
    cos, sin = text.rope_cos[pos], text.rope_sin[pos]

    def forward() -> torch.Tensor:
        kv = DenseKVCache(tiny.model.kv_shape, 16, rows, torch.float32, "cpu", prefix_len=0)

        def attend(layer: int, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            q, k, v = text.blocks[layer].attn.split_qkv(qkv, cos, sin)
            return kv.attend(layer, q, k, v, positions)

        return text._fused_forward(x, pos, attend)

    monkeypatch.setattr(fused_products, "PARALLEL_BRANCH", False)
    one = forward()
    monkeypatch.setattr(fused_products, "PARALLEL_BRANCH", True)
    monkeypatch.setattr(fused_products, "EARLY_MLP_MAX_ROWS", 0)
    split = forward()
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fused_products, "EARLY_MLP_MAX_ROWS", rows)
    early = forward()  # the whole MLP forked off, QKV alone before the attention
    torch.testing.assert_close(early, one, atol=1e-5, rtol=1e-5)
    prod = text._stacked[0]
    hidden = torch.randn(rows, cfg.ff_dim, generator=g)
    pending = prod.start_branch(hidden)
    w_fc2 = prod.w_out[:, cfg.dim :]
    fc2 = pending.sums[pending.n_proj :].sum(0)
    torch.testing.assert_close(fc2, hidden @ w_fc2.t(), atol=1e-4, rtol=1e-4)
    h = torch.randn(rows, cfg.dim, generator=g)
    qkv, gelu_fc1 = prod.qkv_and_hidden(h)
    assert torch.equal(prod.qkv(h), qkv)  # the same columns, launched apart
    mlp = prod.start_mlp(h).sums[pending.n_proj :].sum(0)
    torch.testing.assert_close(mlp, gelu_fc1 @ w_fc2.t(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="sums_out"):
        kern.skinny_gemm.skinny_linear(hidden, w_fc2, sums_out=torch.zeros(1, rows, cfg.dim))
