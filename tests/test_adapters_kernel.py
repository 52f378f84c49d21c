"""The grouped LoRA kernels' arithmetic on the CPU, through Triton's interpreter (where Triton
is installed; the GPU runs the same kernels compiled in test_adapters_gpu.py): the stacked
shrink of several targets, the two-output expand with its GELU, and the decoder's fused path
against the reference's per-target arithmetic. Random shapes, uneven slots, rows without an
adapter. fp32 and fp16 (the interpreter's bf16 products are not NumPy's to compute). The
fused path's glue in `LoraBatch` also runs against the kernels' contract written in PyTorch,
so that it is checked where Triton is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tests.support.interpreted import interpreted_copy
from vlm_server.models.common.layers import gelu_tanh
from vlm_server.models.common.lora_kernel import Partials, Target
from vlm_server.models.interface import LoadedModel
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.lora import files
from vlm_server.models.lora.bank import LoraBank, LoraBatch
from vlm_server.models.lora.spec import LoraTargets, SingleLora
from vlm_server.models.lora.writer import random_state


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    """A copy of models/common/lora_kernel.py whose kernels run in Triton's interpreter (the
    module the server imports keeps its compiled kernels)."""
    from vlm_server.models.common import lora_kernel

    with interpreted_copy(lora_kernel) as module:
        assert module.AVAILABLE
        yield module


def _torch_shrink(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor) -> Partials:
    parts = torch.zeros(x.shape[0], 1, a.shape[1])
    for t, s in enumerate(index.tolist()):
        if s >= 0:
            parts[t, 0] = x[t].float() @ a[s].float().T
    return Partials(parts)


def _torch_delta(target: Target, t: int, s: int) -> torch.Tensor:
    r = target.b.shape[2]
    v = target.partials.parts[t].sum(0)[target.col : target.col + r]
    return v.to(target.b.dtype).float() @ target.b[s].float().T


def _torch_expand(
    index: torch.Tensor,
    first: Target,
    second: Target | None = None,
    gelu: bool = False,
    same_out: bool = False,
    shrink_after: torch.Tensor | None = None,
) -> Partials | None:
    targets = [(first, second)] if same_out else [(first,), (second,)]
    for j, terms in enumerate(targets):
        if terms[0] is None:
            continue
        out = terms[0].out
        for t, s in enumerate(index.tolist()):
            y = out[t].float()
            if s >= 0:
                y = y + sum(_torch_delta(term, t, s) for term in terms if term is not None)
            y = y.to(out.dtype)
            out[t] = gelu_tanh(y.float()).to(out.dtype) if gelu and j == 1 else y
    if shrink_after is None:
        return None
    assert second is not None
    return _torch_shrink(second.out, shrink_after, index)


# The kernels' contract token by token in PyTorch: `LoraBatch`'s fused glue (groups, columns,
# pairs of outputs, where the GELU goes) is checked with it where Triton is not installed.
TORCH_KERNELS = SimpleNamespace(shrink=_torch_shrink, expand=_torch_expand, Target=Target)


@pytest.fixture(params=["torch", "interpreted"])
def any_kernels(request: pytest.FixtureRequest) -> object:
    if request.param == "torch":
        return TORCH_KERNELS
    return request.getfixturevalue("kernels")


def _per_token_v(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x @ A[slot]^T`` token by token, in fp64 (zeros for tokens without an adapter)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(index.tolist()):
        if s >= 0:
            out[t] = x[t].double() @ a[s].double().T
    return out


def _uneven(g: torch.Generator, t: int, slots: int) -> torch.Tensor:
    """Most tokens on slot 0, a few on the others, some on none (-1)."""
    weights = torch.tensor([0.2, 0.6] + [0.2 / max(1, slots - 1)] * (slots - 1))
    return torch.multinomial(weights, t, replacement=True, generator=g).to(torch.int32) - 1


@pytest.mark.parametrize("seed", range(5))
def test_the_stacked_shrink_equals_each_tokens_products(kernels: ModuleType, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t, k = [(1, 40), (37, 300), (70, 129), (16, 1100), (300, 700)][seed]
    slots, r = [1, 3, 4, 2, 3][seed], [4, 8, 5, 16, 4][seed]
    layers = 2
    stacked = torch.randn(slots, layers, 3 * r, k, generator=g) * 0.1  # three targets' A's
    a = stacked[:, 1]  # one layer's view, as the bank hands it
    x = torch.randn(t, k, generator=g)
    index = _uneven(g, t, slots)
    partials = kernels.shrink(x, a, index)
    got = partials.parts.sum(1)[:, : 3 * r].double()
    used = index >= 0
    want = _per_token_v(x, a, index)
    torch.testing.assert_close(got[used], want[used], atol=1e-4, rtol=1e-4)
    assert partials.splits >= min(2, k // 128)  # a long K is spread over programs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_the_two_output_expand_adds_in_place_and_applies_gelu(
    kernels: ModuleType, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    t, k, slots, r = [(5, 48, 2, 4), (33, 200, 5, 8), (80, 64, 3, 16)][seed]
    n1, n2 = [(40, 300), (130, 17), (64, 64)][seed]
    a = (torch.randn(slots, 2 * r, k, generator=g) * 0.2).to(dtype)
    b1 = (torch.randn(slots, n1, r, generator=g) * 0.2).to(dtype)
    b2 = (torch.randn(slots, n2, r, generator=g) * 0.2).to(dtype)
    x = torch.randn(t, k, generator=g).to(dtype)
    index = _uneven(g, t, slots)
    base1, base2 = torch.randn(t, n1, generator=g).to(dtype), torch.randn(t, n2).to(dtype)
    y1, y2 = base1.clone(), base2.clone()
    parts = kernels.shrink(x, a, index)
    kernels.expand(
        index, kernels.Target(parts, 0, b1, y1), kernels.Target(parts, r, b2, y2), gelu=True
    )
    # The reference's order: v rounded to the weights' dtype, out + delta rounded once.
    v = _per_token_v(x, a, index).to(dtype).double()
    d1 = torch.zeros(t, n1, dtype=torch.float64)
    d2 = torch.zeros(t, n2, dtype=torch.float64)
    for i, s in enumerate(index.tolist()):
        if s >= 0:
            d1[i] = v[i, :r] @ b1[s].double().T
            d2[i] = v[i, r:] @ b2[s].double().T
    want1 = (base1.double() + d1).to(dtype)
    want2 = torch.nn.functional.gelu((base2.double() + d2).to(dtype).float(), approximate="tanh")
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(y1.float(), want1.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(y2.float(), want2.to(dtype).float(), atol=tol, rtol=tol)
    none = index < 0
    assert torch.equal(y1[none], base1[none])  # no adapter: untouched, bit for bit
    # ... but the GELU reaches every row of its output
    plain = torch.nn.functional.gelu(base2[none].float(), approximate="tanh").to(dtype)
    torch.testing.assert_close(y2[none].float(), plain.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_deltas_summed_into_one_output(kernels: ModuleType, dtype: torch.dtype) -> None:
    """proj's (from the stacked shrink) and fc2's (from its own) into one branch, summed
    before one rounding; fp32 split sums take them unrounded."""
    g = torch.Generator().manual_seed(11)
    t, d, f, slots, r = 21, 64, 256, 3, 8
    a_in = (torch.randn(slots, 3 * r, d, generator=g) * 0.2).to(dtype)
    a_fc2 = (torch.randn(slots, r, f, generator=g) * 0.2).to(dtype)
    b_proj = (torch.randn(slots, d, r, generator=g) * 0.2).to(dtype)
    b_fc2 = (torch.randn(slots, d, r, generator=g) * 0.2).to(dtype)
    h, hidden = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, f, generator=g).to(dtype)
    index = _uneven(g, t, slots)
    v_proj = _per_token_v(h, a_in, index)[:, r : 2 * r].to(dtype).double()
    v_fc2 = _per_token_v(hidden, a_fc2, index).to(dtype).double()
    delta = torch.zeros(t, d, dtype=torch.float64)
    for i, s in enumerate(index.tolist()):
        if s >= 0:
            delta[i] = v_proj[i] @ b_proj[s].double().T + v_fc2[i] @ b_fc2[s].double().T
    for out_dtype in (dtype, torch.float32):
        base = torch.randn(t, d, generator=g).to(out_dtype)
        out = base.clone()
        proj = kernels.Target(kernels.shrink(h, a_in, index), r, b_proj, out)
        fc2 = kernels.Target(kernels.shrink(hidden, a_fc2, index), 0, b_fc2, out)
        kernels.expand(index, proj, fc2, same_out=True)
        want = (base.double() + delta).to(out_dtype)
        tol = 1e-4 if out_dtype == torch.float32 and dtype == torch.float32 else 4e-3
        torch.testing.assert_close(out.double(), want.double(), atol=tol, rtol=tol)
        assert torch.equal(out[index < 0], base[index < 0])


def _padded(g: torch.Generator, ranks: list[int], shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """Random stacked weights [slots, *shape] (times 0.2), each slot zero past its rank along
    ``dim`` (of ``shape``) in every chunk of ``max(ranks)``, as the bank pads a lower rank."""
    w = torch.randn(len(ranks), *shape, generator=g) * 0.2
    r = max(ranks)
    for s, rank in enumerate(ranks):
        for at in range(0, shape[dim], r):
            w[s].narrow(dim, at + rank, r - rank).zero_()
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 5, 32])
def test_the_expand_shrinks_the_finished_hidden_layer_for_the_sum(
    kernels: ModuleType, t: int, dtype: torch.dtype
) -> None:
    """qkv's and fc1's expand (fc1 GELU'd) with fc2's shrink in the same launch: its outputs
    bit for bit those of the expand without it, fc2's partials the stored hidden layer times
    each row's slot's A (ranks below the maximum zero-padded), and proj's and fc2's deltas
    summed from them as from the grouped shrink's; rows without an adapter untouched."""
    g = torch.Generator().manual_seed(t)
    d, f, ranks = {1: (32, 700, [8, 3]), 5: (48, 1100, [5, 8, 2]), 32: (64, 1500, [8, 1, 6, 8])}[t]
    r, slots = max(ranks), len(ranks)
    a_in = _padded(g, ranks, (3 * r, d), 0).to(dtype)
    # One layer of a bank-like buffer (strides of its own), as `LoraBatch` hands it.
    a_fc2 = _padded(g, ranks, (2, r, f), 1)[:, 1].to(dtype)
    bs = {n: _padded(g, ranks, (w, r), 1).to(dtype) for n, w in
          [("qkv", 3 * d), ("fc1", f), ("proj", d), ("fc2", d)]}  # fmt: skip
    h = torch.randn(t, d, generator=g).to(dtype)
    index = torch.randint(-1, slots, (t,), generator=g).to(torch.int32)
    if t > 1:
        index[:2] = torch.tensor([-1, slots - 1])  # a row without an adapter, the last slot
    base = {n: torch.randn(t, b.shape[1], generator=g).to(dtype) for n, b in bs.items()}
    parts = kernels.shrink(h, a_in, index)
    o = {n: v.clone() for n, v in base.items()}
    fc2 = kernels.expand(
        index, kernels.Target(parts, 0, bs["qkv"], o["qkv"]),
        kernels.Target(parts, 2 * r, bs["fc1"], o["fc1"]), gelu=True, shrink_after=a_fc2,
    )  # fmt: skip
    plain = {n: v.clone() for n, v in base.items()}
    kernels.expand(
        index, kernels.Target(parts, 0, bs["qkv"], plain["qkv"]),
        kernels.Target(parts, 2 * r, bs["fc1"], plain["fc1"]), gelu=True,
    )  # fmt: skip
    assert torch.equal(o["qkv"], plain["qkv"]) and torch.equal(o["fc1"], plain["fc1"])
    assert fc2.parts.shape[:2] == (t, -(-f // kernels.SHRINK_COLS))
    used = index >= 0
    hidden = o["fc1"]
    want_v = _per_token_v(hidden, a_fc2, index)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    got_v = fc2.parts.sum(1)[:, :r].double()
    torch.testing.assert_close(got_v[used], want_v[used], atol=tol, rtol=tol)
    # The sum into the branch, from the folded partials and from the grouped shrink's.
    grouped = kernels.shrink(hidden, a_fc2, index)
    branch = torch.randn(t, d, generator=g).to(dtype)
    sums = []
    for p_fc2 in (fc2, grouped):
        out = branch.clone()
        kernels.expand(
            index, kernels.Target(parts, r, bs["proj"], out),
            kernels.Target(p_fc2, 0, bs["fc2"], out), same_out=True,
        )  # fmt: skip
        sums.append(out)
    v_proj = _per_token_v(h, a_in, index)[:, r : 2 * r].to(dtype).double()
    want = branch.double().clone()
    for i, s in enumerate(index.tolist()):
        if s >= 0:
            fc2_delta = want_v[i].to(dtype).double() @ bs["fc2"][s].double().T
            want[i] += v_proj[i] @ bs["proj"][s].double().T + fc2_delta
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    for got in sums:
        torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=tol, rtol=tol)
        assert torch.equal(got[~used], branch[~used])
    torch.testing.assert_close(sums[0].float(), sums[1].float(), atol=tol, rtol=tol)
    assert not torch.equal(sums[0][used], branch[used])  # deltas were added


def test_a_tokens_result_does_not_depend_on_the_rest_of_the_batch(kernels: ModuleType) -> None:
    """The other tokens' inputs and slots change; each kept token's delta stays bit for bit
    (every output written by one program, sums in a fixed order: no atomics)."""
    g = torch.Generator().manual_seed(7)
    t, k, n, slots, r = 24, 300, 96, 4, 8
    a = torch.randn(slots, r, k, generator=g) * 0.1
    b = torch.randn(slots, n, r, generator=g) * 0.1
    x = torch.randn(t, k, generator=g)
    index = _uneven(g, t, slots)

    def delta(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(t, n)
        kernels.expand(index, kernels.Target(kernels.shrink(x, a, index), 0, b, y))
        return y

    first = delta(x, index)
    assert torch.equal(first, delta(x, index))
    keep = torch.arange(t) % 3 == 0
    x2 = torch.where(keep[:, None], x, torch.randn(t, k, generator=g))
    index2 = torch.where(keep, index, torch.randint(-1, slots, (t,), generator=g).int())
    assert torch.equal(first[keep], delta(x2, index2)[keep])


TARGETS = LoraTargets(
    3,
    {"qkv": (32, 96), "proj": (32, 32), "fc1": (32, 128), "fc2": (128, 32)},
    shared=(("qkv", "proj", "fc1"),),
)


def _bank(ranks: list[int], max_rank: int) -> tuple[LoraBank, list[files.AdapterWeights]]:
    bank = LoraBank(TARGETS, len(ranks), max_rank, torch.float32, "cpu")
    adapters = []
    for slot, rank in enumerate(ranks):
        state = {files.rename(k): v for k, v in random_state(TARGETS, rank, seed=slot).items()}
        w = files.validate(state, TARGETS, max_rank, f"w{slot}")
        bank.write(slot, bank.staging(w), w.rank)
        adapters.append(w)
    return bank, adapters


def test_the_fused_block_path_equals_each_targets_own_delta(any_kernels: ModuleType) -> None:
    """The decoder's calls (one shrink of qkv, proj and fc1; qkv and fc1 expanded in one
    launch with the GELU; proj beside fc2, or both into their sum) against the same calls
    target by target."""
    bank, _ = _bank([8, 3, 5], 8)
    g = torch.Generator().manual_seed(3)
    index = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32)
    h = torch.randn(1, 7, 32, generator=g)
    outs = {t: torch.randn(1, 7, n, generator=g) for t, (_, n) in TARGETS.targets.items()}
    results = []
    for batch in (LoraBatch(bank, index), LoraBatch(bank, index, kernels=any_kernels)):
        o = {t: v.clone() for t, v in outs.items()}
        o["branch"] = outs["proj"] + outs["fc2"]
        given = [o["qkv"], o["fc1"], o["proj"], o["fc2"], o["branch"]]
        shared = batch.shrink(1, h, ("qkv", "proj", "fc1"))
        qkv, act = batch.expand(1, [(shared, "qkv", o["qkv"]), (shared, "fc1", o["fc1"])], True)
        hidden = batch.shrink(1, act, ("fc2",))
        proj, fc2 = batch.expand(1, [(shared, "proj", o["proj"]), (hidden, "fc2", o["fc2"])])
        # As the fused-products forward adds them: both into the branch (proj + fc2).
        branch = batch.expand_sum(1, [(shared, "proj"), (hidden, "fc2")], o["branch"])
        results.append((qkv, act, proj, fc2, branch))
    exact, fused = results
    for want, got in zip(exact, fused, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # The kernel path wrote the layers' outputs in place (no delta tensors, no adds).
    assert all(y is x for y, x in zip(fused, given, strict=True))


def test_the_expand_then_shrink_gives_fc2s_shrink(any_kernels: ModuleType) -> None:
    """The decoder's calls with fc2's shrink from the expand that GELUs fc1 (the kernel path
    folds it, the exact path shrinks apart) against the same calls target by target."""
    bank, _ = _bank([8, 3, 5], 8)
    g = torch.Generator().manual_seed(4)
    index = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32)
    h = torch.randn(7, 32, generator=g)
    outs = {t: torch.randn(7, n, generator=g) for t, (_, n) in TARGETS.targets.items()}
    outs["branch"] = outs["proj"] + outs["fc2"]
    results = []
    for batch in (LoraBatch(bank, index), LoraBatch(bank, index, kernels=any_kernels)):
        o = {t: v.clone() for t, v in outs.items()}
        shared = batch.shrink(1, h, ("qkv", "proj", "fc1"))
        pairs = [(shared, "qkv", o["qkv"]), (shared, "fc1", o["fc1"])]
        (qkv, act), hidden = batch.expand_then_shrink(1, pairs, "fc2")
        assert (hidden is None) == (batch.kernels is None)
        if hidden is None:
            hidden = batch.shrink(1, act, ("fc2",))
        branch = batch.expand_sum(1, [(shared, "proj"), (hidden, "fc2")], o["branch"])
        results.append((qkv, act, branch))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_expands_of_one_or_three_outputs_pair_up_with_the_gelu_last(
    any_kernels: ModuleType, n: int
) -> None:
    """An odd number of outputs: the one left over launches alone, the GELU's output second
    in the last launch; a lone output gets its GELU after its launch."""
    bank, _ = _bank([4, 2], 4)
    g = torch.Generator().manual_seed(n)
    index = torch.tensor([1, 0, -1, 1, 0], dtype=torch.int32)
    h = torch.randn(5, 32, generator=g)
    names = ["proj", "qkv", "fc1"][-n:]
    outs = {t: torch.randn(5, TARGETS.targets[t][1], generator=g) for t in names}
    results = []
    for batch in (LoraBatch(bank, index), LoraBatch(bank, index, kernels=any_kernels)):
        shared = batch.shrink(2, h, ("qkv", "proj", "fc1"))
        pairs = [(shared, t, outs[t].clone()) for t in names]
        results.append(batch.expand(2, pairs, gelu_last=True))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_the_decoder_with_the_kernels_equals_the_reference_per_row(
    tiny: LoadedModel, any_kernels: ModuleType
) -> None:
    """The tiny model's decoder over a batch of rows with two adapters and none, through the
    interpreted kernels, against the reference (`SingleLora`) row by row."""
    model = tiny.model
    text = model.text
    targets = text.lora_targets
    bank = LoraBank(targets, 2, 4, torch.float32, "cpu")
    adapters = []
    for slot, rank in enumerate([4, 2]):
        state = {files.rename(k): v for k, v in random_state(targets, rank, 20 + slot).items()}
        w = files.validate(state, targets, 4, f"a{slot}")
        bank.write(slot, bank.staging(w), w.rank)
        adapters.append(w)
    rows = [1, -1, 0, 1]
    b, t, cfg = len(rows), 3, tiny.config.text
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, t, cfg.dim, generator=g)
    pos = torch.arange(t).repeat(b, 1)

    def cache(batch: int) -> DenseKVCache:
        return DenseKVCache(model.kv_shape, 16, batch, torch.float32, "cpu", prefix_len=0)

    index = torch.tensor(rows, dtype=torch.int32).repeat_interleave(t)
    with torch.no_grad():
        got = text(x, pos, cache(b), LoraBatch(bank, index, kernels=any_kernels))
        for i, slot in enumerate(rows):
            lora = SingleLora(adapters[slot]) if slot >= 0 else None
            args = (x[i : i + 1], pos[i : i + 1], cache(1))
            want = text(*args) if lora is None else text(*args, lora)
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-4, rtol=1e-4)
