"""Moondream 3's expert-layer kernels in Triton's interpreter on the CPU: route + grouping and
combine against the PyTorch `route` / `align` / `combine_slots`, the grouped kernels with each
tile of the table against the plain path, and what CUDA graphs need (shapes only, no host reads)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from tests.support.interpreted import interpreted_moe
from vlm_server.models.moondream3 import moe, moe_triton
from vlm_server.models.moondream3.config import MoeConfig

pytest.importorskip("triton")


kern = pytest.fixture(scope="module")(interpreted_moe)


def _logits(n: int, e: int, k: int, dtype: torch.dtype, uneven: bool, seed: int) -> torch.Tensor:
    """Distinct logits per token (exact in bf16: eighths below 8), so the top-k is unique."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(e, generator=gen) for _ in range(n)]).float() / 8 - 4
    if uneven and n > 4:  # most tokens on the same experts, several experts get nothing
        rows[: n * 3 // 4, :k] += 16
    return rows.to(dtype)


def _ids(n: int, k: int, e: int, uneven: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    if uneven and n > 4:
        ids[: n * 3 // 4] = torch.arange(k)
    return ids


def _same_grouping(got: object, ids: torch.Tensor, n_experts: int, block_m: int) -> None:
    from vlm_server.models.moondream3.moe_routing import align

    pair_ids, block_expert, used = align(ids, n_experts, block_m)
    assert got.block_m == block_m  # type: ignore[attr-defined]
    assert torch.equal(got.used, used)  # type: ignore[attr-defined]
    assert torch.equal(got.pair_ids, pair_ids)  # type: ignore[attr-defined]
    assert torch.equal(got.block_expert, block_expert)  # type: ignore[attr-defined]


# ---- route + grouping ----------------------------------------------------------------------


def _wide(*values: object, default: bool) -> object:
    """A case of the widest step: the suite runs one such case, the rest with --run-slow
    (under the interpreter each takes a second or more)."""
    return pytest.param(*values, marks=() if default else pytest.mark.slow)


_ROUTE_CASES = [
    (n, k, e, block_m, dtype, uneven)
    for n, k, e, block_m in [(1, 8, 64, 16), (3, 2, 8, 16), (37, 3, 8, 64), (70, 3, 5, 16)]
    for dtype in (torch.float32, torch.bfloat16)
    for uneven in (False, True)
] + [
    _wide(300, 8, 64, 32, dtype, uneven, default=dtype == torch.bfloat16 and uneven)
    for dtype in (torch.float32, torch.bfloat16)
    for uneven in (False, True)
]


@pytest.mark.parametrize("n, k, e, block_m, dtype, uneven", _ROUTE_CASES)
def test_route_align_equals_route_then_align(
    kern: SimpleNamespace, n: int, k: int, e: int, block_m: int, dtype: torch.dtype, uneven: bool
) -> None:
    logits = _logits(n, e, k, dtype, uneven, seed=n + k)
    weights, ids, routing = kern.routing.route_align(logits, k, block_m)
    want_w, want_ids = moe.route(logits, k)
    assert ids.dtype == want_ids.dtype and torch.equal(ids, want_ids)
    assert weights.dtype == dtype
    # the same exp per term; only the k-term sum's order may differ from PyTorch's
    torch.testing.assert_close(
        weights, want_w, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0
    )
    _same_grouping(routing, ids, e, block_m)


def test_route_breaks_ties_towards_the_lower_expert(kern: SimpleNamespace) -> None:
    logits = torch.zeros(3, 16)
    logits[1, 9] = 1.0
    weights, ids, _ = kern.routing.route_align(logits, 4, 16)
    assert ids[0].tolist() == [0, 1, 2, 3] and ids[1].tolist() == [9, 0, 1, 2]
    assert torch.equal(weights[0], torch.full((4,), 0.25))


@pytest.mark.parametrize("n", [1, 3, 37, 300])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("uneven", [False, True])
def test_align_fused_equals_align(
    kern: SimpleNamespace, n: int, block_m: int, uneven: bool
) -> None:
    k, e = (8, 64) if n == 300 else (3, 8)
    ids = _ids(n, k, e, uneven, seed=n)
    _same_grouping(kern.routing.align_fused(ids, e, block_m), ids, e, block_m)


@pytest.mark.parametrize(
    "max_programs, n, k, e",
    [(m, n, k, e) for m in (1, 3, 5) for n, k, e in [(70, 3, 5), (37, 1, 7)]]
    + [_wide(m, 300, 8, 64, default=m == 3) for m in (1, 3, 5)],
)
def test_several_chunks_a_program_group_the_same(
    kern: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, max_programs: int, n: int, k: int,
    e: int,
) -> None:  # fmt: skip
    """Wide steps spread their chunks over at most MAX_PROGRAMS programs (the last one short):
    the same grouping, and the same ids and weights, as one chunk a program."""
    logits = _logits(n, e, k, torch.bfloat16, True, seed=n)
    want = kern.routing.route_align(logits, k, 16)
    monkeypatch.setattr(kern.routing, "MAX_PROGRAMS", max_programs)
    weights, ids, routing = kern.routing.route_align(logits, k, 16)
    assert torch.equal(ids, want[1]) and torch.equal(weights, want[0])
    _same_grouping(routing, ids, e, 16)


def test_the_row_blocks_hold_every_routing_and_a_decode_step_needs_few() -> None:
    """`n_row_blocks` bounds the blocks any routing of its pairs uses (random routings and the
    extremes: all distinct, all on one expert, one row more than whole blocks each)."""
    from vlm_server.models.moondream3.moe_routing import n_row_blocks

    shapes = [(1, 8, 64, 16), (2, 8, 64, 16), (5, 3, 8, 16), (37, 8, 64, 64), (300, 8, 64, 32)]
    for n, k, e, m in shapes:
        bound = n_row_blocks(n * k, e, m)
        cases = [_ids(n, k, e, uneven, seed) for uneven in (False, True) for seed in range(4)]
        cases.append(torch.zeros(n * k, dtype=torch.int64))  # one expert takes every pair
        cases.append(torch.arange(n * k) % e)  # as even as possible: the most groups
        # The most blocks: every expert one pair, the rest in whole blocks, each on another
        # expert (each such block then starts one past a block boundary).
        groups = min(e, n * k)
        rest = torch.arange(n * k - groups) // m % groups
        cases.append(torch.cat([torch.arange(groups), rest]))
        for ids in cases:
            counts = torch.bincount(ids.reshape(-1), minlength=e)
            assert int(((counts + m - 1) // m).sum()) <= bound, (n, k, e, m)
    assert n_row_blocks(8, 64, 16) == 8  # one token of top-8: no empty row blocks
    assert n_row_blocks(512, 64, 16) == (512 + 64 * 15) // 16  # a wide step: the spread bound


def test_align_fused_with_all_pairs_on_one_expert(kern: SimpleNamespace) -> None:
    ids = torch.full((300, 1), 5)  # more tokens than one program routes: two kernels
    _same_grouping(kern.routing.align_fused(ids, 7, 16), ids, 7, 16)


# ---- combine -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, d", [(1, 8, 2048), (5, 3, 700), (33, 2, 64)])
def test_combine_is_bit_exact(
    kern: SimpleNamespace, dtype: torch.dtype, n: int, k: int, d: int
) -> None:
    gen = torch.Generator().manual_seed(n * d)
    y = (torch.randn(n, k, d, generator=gen) * 3).to(dtype)
    weights = torch.softmax(torch.randn(n, k, generator=gen), -1).to(dtype)
    assert torch.equal(kern.routing.combine_fused(y, weights), moe.combine_slots(y, weights))


# ---- the grouped kernels with each tile ----------------------------------------------------


def _tile_cases(mt: SimpleNamespace) -> list[object]:
    t = mt.Tile
    return [
        *(tiles for _, tiles in mt.TILES),
        mt.ExpertTiles(16, t(), t()),  # Triton's default warps and stages
        mt.ExpertTiles(16, t(32, 32, 4, 2, 3), t(32, 16, 4, 2, 2)),  # split K, uneven splits
    ]


def _weights(e: int, d: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, 2 * i, d, generator=gen) / d**0.5
    w1[:, i:] *= 0.25
    return w1, torch.randn(e, d, i, generator=gen) / i**0.5


def _delta(d: int, i: int, seed: int) -> moe.ExpertDelta:
    """A stand-in adapter: a fixed linear map per target, scaled by the pair's expert."""
    gen = torch.Generator().manual_seed(seed)
    maps = {"fc1": torch.randn(d, 2 * i, generator=gen) * 0.1}
    maps["fc2"] = torch.randn(i, d, generator=gen) * 0.1

    def delta(target: str, rows, experts, tokens):  # type: ignore[no-untyped-def]
        keep = ((tokens >= 0) & (experts % 2 == 0)).float()[:, None]
        return (rows.float() @ maps[target]) * (experts[:, None] + 1) * keep

    return delta


N_TILE_CASES = len(moe_triton.TILES) + 2  # the table's, the default tile, a split-K one


@pytest.mark.parametrize("case", range(N_TILE_CASES))
@pytest.mark.parametrize("fp8", [False, True])
def test_experts_fused_with_each_tile_equals_the_loop(
    kern: SimpleNamespace, case: int, fp8: bool
) -> None:
    from vlm_server.models.moondream3 import fp8_experts

    mt = kern.triton
    tiles = _tile_cases(mt)[case]
    n, k, e, d, i = 37, 3, 8, 64, 32
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(case))
    ids = _ids(n, k, e, uneven=case % 2 == 1, seed=case)
    w1, w2 = _weights(e, d, i, seed=case)
    s1 = s2 = None
    if fp8:
        (w1, s1), (w2, s2) = fp8_experts.quantize(w1), fp8_experts.quantize(w2)
    got = mt.experts_fused(x, ids, w1, w2, s1, s2, tiles=tiles)
    d1 = w1 if s1 is None else fp8_experts.dequantize(w1, s1, torch.float32)
    d2 = w2 if s2 is None else fp8_experts.dequantize(w2, s2, torch.float32)
    torch.testing.assert_close(got, moe.experts_loop(x, ids, d1, d2), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", [0, N_TILE_CASES - 1])
def test_both_launch_orders_compute_the_same_bits(
    kern: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, case: int
) -> None:
    """Columns first or rows first, each program computes the same block."""
    mt = kern.triton
    tiles = _tile_cases(mt)[case]
    n, k, e, d, i = 37, 3, 8, 64, 32
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(case))
    ids = _ids(n, k, e, uneven=True, seed=case)
    w1, w2 = _weights(e, d, i, seed=case)
    got = []
    for first in (True, False):
        monkeypatch.setattr(mt, "COLUMNS_FIRST", first)
        assert mt._grid(5, 3, 1) == (((3, 5, 1), True) if first else ((5, 3, 1), False))
        got.append(mt.experts_fused(x, ids, w1, w2, None, None, tiles=tiles))
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], moe.experts_loop(x, ids, w1, w2), atol=1e-4, rtol=1e-4)
    assert mt._grid(70000, 3, 1) == ((70000, 3, 1), False)  # past CUDA's second dimension


@pytest.mark.parametrize("case", [0, N_TILE_CASES - 2, N_TILE_CASES - 1])
def test_experts_fused_with_an_adapter_equals_the_loop(kern: SimpleNamespace, case: int) -> None:
    mt = kern.triton
    tiles = _tile_cases(mt)[case]
    n, k, e, d, i = 21, 2, 6, 48, 40
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(9))
    ids = _ids(n, k, e, uneven=True, seed=9)
    w1, w2 = _weights(e, d, i, seed=9)
    delta = _delta(d, i, seed=2)
    got = mt.experts_fused(x, ids, w1, w2, None, None, delta, tiles=tiles)
    want = moe.experts_loop_lora(x, ids, w1, w2, delta)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 37, 80])
def test_the_fused_layer_equals_the_plain_layer(
    kern: SimpleNamespace, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MoeMLP` with method "fused" (router, route + grouping, grouped kernels, combine) on
    the interpreted kernels, against the loop; N = 80 takes the two-kernel grouping."""
    monkeypatch.setattr(moe, "moe_triton", kern.triton)
    monkeypatch.setattr(moe, "moe_routing", kern.routing)
    torch.manual_seed(n)
    mlp = moe.MoeMLP(32, MoeConfig(n_experts=8, top_k=3, expert_dim=16, start_layer=0))
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    h = torch.randn(1, n, 32)
    mlp.method = "loop"
    want = mlp(h)
    mlp.method = "fused"
    torch.testing.assert_close(mlp(h), want, atol=1e-4, rtol=1e-4)


# ---- what CUDA graphs need -----------------------------------------------------------------


def test_the_fused_path_reads_nothing_back_to_the_host() -> None:
    from vlm_server.models.moondream3 import moe_norm, moe_routing, moe_triton

    fns = [
        moe.MoeMLP._fused,
        moe.MoeMLP._fused_pairs,
        moe.MoeMLP.pairs,
        moe_norm.add_combine_layernorm,
        moe_routing._group,
        moe_routing.route_align,
        moe_routing.align_fused,
        moe_routing.combine_fused,
        moe_triton.experts_fused,
        moe_triton._split,
        moe_triton._row_of_pair,
        moe_triton.pick_tiles,
    ]
    for fn in fns:
        src = inspect.getsource(fn)
        for read in (".item(", ".tolist(", ".cpu(", ".numpy(", "int(", "float(", "bool("):
            assert read not in src, f"{fn.__qualname__} reads a value back: {read}"


def test_routing_grids_and_buffers_depend_on_shapes_only(
    kern: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    mr = kern.routing
    grids: list[tuple[str, tuple[int, ...]]] = []

    class Recorder:
        def __init__(self, name: str, kernel: object) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid: tuple[int, ...]) -> object:
            grids.append((self.name, grid))
            return self.kernel[grid]  # type: ignore[index]

    for name in ("_route_kernel", "_align_kernel"):
        monkeypatch.setattr(mr, name, Recorder(name, getattr(mr, name)))
    shapes = []
    for n in (5, 90):
        runs = []
        for uneven in (False, True):
            grids.clear()
            w, ids, r = mr.route_align(_logits(n, 16, 4, torch.float32, uneven, seed=n), 4, 16)
            runs.append(([t.shape for t in (w, ids, *r[:3])], list(grids)))
        assert runs[0] == runs[1]
        shapes.append(runs[0][1])
    assert [name for name, _ in shapes[0]] == ["_route_kernel"]  # decode: one launch
    assert [name for name, _ in shapes[1]] == ["_route_kernel", "_align_kernel"]
