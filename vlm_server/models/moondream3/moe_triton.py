"""Fused expert layers in Triton: the step's (token, expert) pairs grouped by expert, one
grouped matmul for fc1 with the expert activation in its epilogue, one for fc2.

1. Grouping (moe_routing.py, Triton; `moe_routing.align` is its PyTorch reference): the pairs
   sorted by expert, each expert's group padded to a multiple of ``block_m`` rows, so every row
   block belongs to one expert. The buffer is sized for the worst case (`moe_routing.n_row_blocks`);
   blocks past the used length exit at once.
2. `_up_kernel`: per row block and tile of the expert width, both halves of fc1 over the
   block's tokens, accumulated in fp32; writes ``gelu_erf(a) * (b + 1)``.
3. `_down_kernel`: fc2 over those rows; writes each pair's output row, unweighted.
4. The routing weights are applied by the combine (`moe_routing.combine_fused`, or
   `moe.combine_slots`), in slot order, as on the plain paths.

Tiles come from `TILES` by token count: decode (a few pairs per expert) reads the chosen
experts' weights once and needs many programs over N and wide K steps; prefill is a grouped
GEMM wanting large tiles. Split-K (decode) writes fp32 partials that a second kernel sums in
split order: no atomics, the same bits on every run.

Expert weights may be FP8 (float8_e4m3fn) with fp32 scales per expert and output row: the
kernels load FP8 tiles, widen them to the activations' dtype for the matmul, and scale the
fp32 accumulator per output column (weights stored in 8 bits, matmuls in 16). INT8 and INT4
weights (docs/quantization.md, bf16 scales) take the same kernels with ``QBITS`` 8 or 4: their
K loops (moe_qweights.py) widen each weight in registers as the plain path dequantizes it.

With a finetune adapter (``delta``) each pair's low-rank deltas are computed first, in pair
order (fc1's from the token's input; fc2's from the pair's row of the up kernel's output,
gathered back into pair order), and each kernel adds its delta to the fp32 accumulator after
the scales: fc1's before the activation, fc2's before the routing weight. Without an adapter
the kernels compile without that load (``HAS_DELTA`` is a compile-time switch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vlm_server.chip_features import device_spec
from vlm_server.chips import FP8_CAPABILITY, ChipSpec, Launch
from vlm_server.models.common import launch_overlap
from vlm_server.models.moondream3 import act_quant, moe_routing
from vlm_server.models.moondream3.fp8_experts import FP8
from vlm_server.models.moondream3.moe_qweights import StoredExperts
from vlm_server.models.moondream3.moe_routing import Routing

try:
    import triton
    import triton.language as tl

    from vlm_server.models.common.launch_overlap import gdc_launch_dependents, gdc_wait
    from vlm_server.models.moondream3.moe_epilogue import _down_epilogue, _up_epilogue
    from vlm_server.models.moondream3.moe_qweights import down_sums, up_sums
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

# An adapter's deltas for rows of (token, expert) pairs (models/lora/spec.py `expert_delta`):
# (target "fc1" or "fc2", the rows' inputs [R, in], their experts [R], their tokens [R], -1:
# padding) -> [R, out], or None where the adapter leaves the target out.
ExpertDelta = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True)
class Tile:
    """One grouped kernel's launch: columns and K step per program, warps, pipeline stages,
    K splits (1: none)."""

    bn: int = 64
    bk: int = 64
    warps: int = 4
    stages: int = 3
    split: int = 1

    def __str__(self) -> str:
        return f"{self.bn}x{self.bk}w{self.warps}s{self.stages}" + (
            f"k{self.split}" if self.split > 1 else ""
        )


@dataclass(frozen=True)
class ExpertTiles:
    """Rows per block (the grouping's ``block_m``) and the up / down kernels' tiles."""

    bm: int
    up: Tile
    down: Tile

    def __str__(self) -> str:
        return f"bm{self.bm} up {self.up} down {self.down}"


# (most tokens, tiles): the first entry whose bound the step's token count meets. Measured on
# an H100 at md3's shapes (64 experts, top-8, FP8 experts; python -m bench.moe_probe, the
# winners by layer time at 1, 8, 32, 64, 730 and 2048 tokens): up to 64 tokens the grouped
# kernels run at the weights' bandwidth floor. Without split-K every tile sums each output
# over K in the same order, so a token's result does not depend on the step's size (split-K
# sums per split first: the engine's batches and a lone request would differ in the last bits).
TILES: tuple[tuple[int, ExpertTiles], ...] = (
    (64, ExpertTiles(16, Tile(32, 256, 4, 3, 1), Tile(32, 256, 4, 3, 1))),
    (1024, ExpertTiles(128, Tile(128, 64, 8, 3, 1), Tile(128, 64, 8, 3, 1))),
    (1 << 62, ExpertTiles(64, Tile(128, 64, 8, 3, 1), Tile(128, 64, 8, 3, 1))),
)

# FP8 activations (`experts_fused` ``fp8_act``, opt-in): steps of at least this many tokens
# (image prefixes, long prompt chunks) run both products on FP8 units, with K steps twice as
# wide (an FP8 stage is half the bytes). Fewer tokens stay in 16 bits: there the products
# stream weights, and FP8 units buy nothing. The tile won at 730, 2920 and 5840 tokens on an
# H100 (python -m bench.moe_fp8_probe; layer 260 / 641 / 1262 us against 16-bit activations'
# 371 / 1222 / 2364).
FP8_ACT_MIN_TOKENS = 256
FP8_ACT_TILES: tuple[tuple[int, ExpertTiles], ...] = (
    (1 << 62, ExpertTiles(128, Tile(128, 128, 8, 4), Tile(128, 128, 8, 4))),
)


# Launch order of the grouped kernels: True runs each row block's column blocks side by side
# (its activation rows come from memory once, then from L2), False each column block's row
# blocks (every column block streams all the rows again: at 5840 tokens fc2's FP8 input is
# 48 MB, read 16 times).
COLUMNS_FIRST = True


def _grid(row_blocks: int, col_blocks: int, splits: int) -> tuple[tuple[int, int, int], bool]:
    """The launch grid and whether it runs columns first (CUDA caps a grid's second
    dimension at 65535: more row blocks than that run rows first)."""
    if COLUMNS_FIRST and row_blocks <= 65535:
        return (col_blocks, row_blocks, splits), True
    return (row_blocks, col_blocks, splits), False


SMEM_MARGIN = 0.9  # of it the pipelined tiles may take (the epilogue's layout changes use some)


def smem_limit(index: int) -> int:
    """Bytes of shared memory one program may use on CUDA device ``index``."""
    return device_spec(index).limits.shared_per_block


def fitted(t: Tile, bm: int, act_bytes: int, w_bytes: int, halves: int, limit: int) -> Tile:
    """``t`` with fewer pipeline stages where its tiles (``bm`` x BK activations, ``halves``
    BK x BN weight tiles, per stage) would not fit ``limit`` bytes of shared memory: the
    table's tiles are the H100's (227 KiB), an RTX 4090 or L40 has 99 KiB."""
    per_stage = bm * t.bk * act_bytes + halves * t.bk * t.bn * w_bytes
    stages = t.stages
    while stages > 1 and stages * per_stage > SMEM_MARGIN * limit:
        stages -= 1
    return t if stages == t.stages else replace(t, stages=stages)


# FP8 expert weights (fp8_experts.py): every chip with FP8 units, Ada's sm_89 on.
FP8_WEIGHTS_CAPABILITY = FP8_CAPABILITY


# Stored expert weights beside 16-bit ones: (values' type, scales' type, QBITS, FP8 row scales).
_STORED = {
    "fp8": ("*fp8e4nv", "*fp32", 0, True),
    "int8": ("*i8", "*bf16", 8, False),
    "int4": ("*u8", "*bf16", 4, False),
}


def launch_configs(chip: ChipSpec) -> list[Launch]:
    """Every launch of the grouped kernels `experts_fused` may pick on ``chip``: each tile of
    `TILES` (16-bit, 8- or 4-bit or, from Ada on, FP8 weights; with and without an adapter's
    deltas) and of `FP8_ACT_TILES`, fitted to the chip's shared memory as the launcher fits
    them (INT4 in groups of 128)."""
    fp8 = chip.capability >= FP8_WEIGHTS_CAPABILITY
    stored = ["16", "int8", "int4", *(["fp8"] if fp8 else [])]
    cases = [(tiles, 2, w, delta) for _, tiles in TILES for w in stored
             for delta in (False, True)]  # fmt: skip
    cases += [(tiles, 1, "fp8", False) for _, tiles in FP8_ACT_TILES] if fp8 else []
    out: list[Launch] = []
    for tiles, act, w, delta in cases:
        w_type, s_type, qbits, row_scales = _STORED.get(w, ("", "", 0, False))
        for name, tile, halves, arg in (
            ("_up_kernel", tiles.up, 2, "x_ptr"),
            ("_down_kernel", tiles.down, 1, "h_ptr"),
        ):
            t = fitted(tile, tiles.bm, act, 2 if w == "16" else 1, halves,
                       chip.limits.shared_per_block)  # fmt: skip
            types = {"w_ptr": w_type, "s_ptr": s_type} if w_type else {}
            types |= {arg: "*fp8e4nv"} if act == 1 else {}
            consts = {"BM": tiles.bm, "BN": t.bn, "BK": t.bk, "SPLIT": t.split}
            consts |= {"HAS_SCALE": row_scales, "HAS_DELTA": delta, "ACT_FP8": act == 1}
            consts |= {"QBITS": qbits, "GROUP": 128} if qbits else {}
            launch = Launch(name, consts, t.warps, t.stages, types)
            if launch not in out:
                out.append(launch)
    return out


def pick_tiles(
    n_tokens: int, table: tuple[tuple[int, ExpertTiles], ...] | None = None
) -> ExpertTiles:
    """The tiles for a step of ``n_tokens`` tokens from ``table`` (default `TILES`)."""
    table = TILES if table is None else table
    for most, tiles in table:
        if n_tokens <= most:
            return tiles
    return table[-1][1]


def available(x: torch.Tensor) -> bool:
    """Whether the fused path can run on ``x`` (CUDA and Triton)."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _row_block(pid_m, block_expert, pairs, n_pairs, BM: tl.constexpr):
        """Row block ``pid_m``'s expert, its rows, their pairs and which are real pairs (not
        padding). (No ``_ptr`` names: a helper, not a launched kernel.)"""
        rows = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(pairs + rows)
        return tl.load(block_expert + pid_m).to(tl.int64), rows, pair, pair < n_pairs

    @triton.jit
    def _up_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        h_ptr,
        part_ptr,
        pair_ptr,
        block_expert_ptr,
        used_ptr,
        d_ptr,
        xs_ptr,
        n_pairs,
        top_k,
        dim,
        width,
        k_per_split,
        HAS_SCALE: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        ACT_FP8: tl.constexpr = False,
        COLUMNS_FIRST: tl.constexpr = False,
        QBITS: tl.constexpr = 0,
        GROUP: tl.constexpr = 128,
        PDL: tl.constexpr = False,
    ):
        """One row block x BN columns of both fc1 halves over a K range (the whole of it
        without split-K, then the epilogue; with it, fp32 partials for `_up_reduce_kernel`).
        ``ACT_FP8``: x is FP8 with a scale per token (``xs_ptr``); FP8 x FP8 products."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        if COLUMNS_FIRST:  # a row block's column blocks run side by side: its rows read once
            pid_m, pid_n = tl.program_id(1), tl.program_id(0)
        else:
            pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        pid_s = tl.program_id(2)
        if pid_m * BM >= tl.load(used_ptr):
            return
        e, rows, pair, valid = _row_block(pid_m, block_expert_ptr, pair_ptr, n_pairs, BM)
        tok = tl.where(valid, pair // top_k, 0).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < width
        acc_a = tl.full((BM, BN), 0.0, tl.float32)
        acc_b = tl.full((BM, BN), 0.0, tl.float32)
        k_lo = pid_s * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, dim)
        if QBITS != 0:  # 8- or 4-bit weights, widened in registers (moe_qweights.py)
            acc_a, acc_b = up_sums(
                acc_a, acc_b, x_ptr + tok * dim, valid, w_ptr, s_ptr, e, cols, col_ok, dim,
                width, k_lo, k_hi, QBITS, GROUP, IEEE, BN, BK,
            )  # fmt: skip
        else:  # 16-bit or FP8 weights, widened to the activations' dtype
            w_base = w_ptr + e * (2 * width) * dim
            for k0 in range(k_lo, k_hi, BK):
                ks = k0 + tl.arange(0, BK)
                k_ok = ks < k_hi
                x = tl.load(
                    x_ptr + tok[:, None] * dim + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w_mask = k_ok[:, None] & col_ok[None, :]
                wa = tl.load(w_base + cols[None, :] * dim + ks[:, None], mask=w_mask, other=0.0)
                wb = tl.load(
                    w_base + (width + cols[None, :]) * dim + ks[:, None], mask=w_mask, other=0.0
                )
                wa = wa.to(x.dtype)
                wb = wb.to(x.dtype)
                if IEEE:
                    acc_a += tl.dot(x, wa, input_precision="ieee")
                    acc_b += tl.dot(x, wb, input_precision="ieee")
                else:
                    acc_a += tl.dot(x, wa)
                    acc_b += tl.dot(x, wb)
        if SPLIT == 1 and ACT_FP8:
            xs = tl.load(xs_ptr + tok, mask=valid, other=0.0)
            _up_epilogue(acc_a, acc_b, e, rows, pair, valid, cols, col_ok, s_ptr, d_ptr, h_ptr,
                         width, HAS_SCALE, HAS_DELTA, xs)  # fmt: skip
        elif SPLIT == 1:
            _up_epilogue(acc_a, acc_b, e, rows, pair, valid, cols, col_ok, s_ptr, d_ptr, h_ptr,
                         width, HAS_SCALE, HAS_DELTA)  # fmt: skip
        else:  # partials [SPLIT, rows, 2 x width], the rows in sorted order
            n_rows = tl.num_programs(1 if COLUMNS_FIRST else 0) * BM
            at = part_ptr + (pid_s * n_rows + rows[:, None]).to(tl.int64) * (2 * width)
            mask = valid[:, None] & col_ok[None, :]
            tl.store(at + cols[None, :], acc_a, mask=mask)
            tl.store(at + width + cols[None, :], acc_b, mask=mask)

    @triton.jit
    def _up_reduce_kernel(
        part_ptr, s_ptr, h_ptr, pair_ptr, block_expert_ptr, used_ptr, d_ptr, n_pairs, width,
        HAS_SCALE: tl.constexpr, HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Split-K's partials of fc1 summed in split order (deterministic), then the epilogue."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        pid_m = tl.program_id(0)
        if pid_m * BM >= tl.load(used_ptr):
            return
        e, rows, pair, valid = _row_block(pid_m, block_expert_ptr, pair_ptr, n_pairs, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < width
        mask = valid[:, None] & col_ok[None, :]
        n_rows = tl.num_programs(0) * BM
        acc_a = tl.full((BM, BN), 0.0, tl.float32)
        acc_b = tl.full((BM, BN), 0.0, tl.float32)
        for s in range(0, SPLIT):
            at = part_ptr + (s * n_rows + rows[:, None]).to(tl.int64) * (2 * width)
            acc_a += tl.load(at + cols[None, :], mask=mask, other=0.0)
            acc_b += tl.load(at + width + cols[None, :], mask=mask, other=0.0)
        _up_epilogue(acc_a, acc_b, e, rows, pair, valid, cols, col_ok, s_ptr, d_ptr, h_ptr,
                     width, HAS_SCALE, HAS_DELTA)  # fmt: skip

    @triton.jit
    def _down_kernel(
        h_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        part_ptr,
        pair_ptr,
        block_expert_ptr,
        used_ptr,
        d_ptr,
        hs_ptr,
        n_pairs,
        dim,
        width,
        k_per_split,
        HAS_SCALE: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        ACT_FP8: tl.constexpr = False,
        COLUMNS_FIRST: tl.constexpr = False,
        QBITS: tl.constexpr = 0,
        GROUP: tl.constexpr = 128,
        PDL: tl.constexpr = False,
    ):
        """fc2 over a row block's activations; as `_up_kernel` for split-K and FP8 inputs
        (a scale per sorted row, ``hs_ptr``)."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        if COLUMNS_FIRST:  # a row block's column blocks run side by side: its rows read once
            pid_m, pid_n = tl.program_id(1), tl.program_id(0)
        else:
            pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        pid_s = tl.program_id(2)
        if pid_m * BM >= tl.load(used_ptr):
            return
        e, rows, pair, valid = _row_block(pid_m, block_expert_ptr, pair_ptr, n_pairs, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < dim
        acc = tl.full((BM, BN), 0.0, tl.float32)
        k_lo = pid_s * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, width)
        if QBITS != 0:  # 8- or 4-bit weights, widened in registers (moe_qweights.py)
            acc = down_sums(
                acc, h_ptr + rows.to(tl.int64) * width, valid, w_ptr, s_ptr, e, cols, col_ok,
                dim, width, k_lo, k_hi, QBITS, GROUP, IEEE, BN, BK,
            )  # fmt: skip
        else:  # 16-bit or FP8 weights, widened to the activations' dtype
            w_base = w_ptr + e * dim * width
            for k0 in range(k_lo, k_hi, BK):
                ks = k0 + tl.arange(0, BK)
                k_ok = ks < k_hi
                h = tl.load(
                    h_ptr + rows[:, None].to(tl.int64) * width + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w = tl.load(
                    w_base + cols[None, :] * width + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                w = w.to(h.dtype)
                if IEEE:
                    acc += tl.dot(h, w, input_precision="ieee")
                else:
                    acc += tl.dot(h, w)
        if SPLIT == 1 and ACT_FP8:
            hs = tl.load(hs_ptr + rows, mask=valid, other=0.0)
            _down_epilogue(acc, e, pair, valid, cols, col_ok, s_ptr, d_ptr, y_ptr, dim,
                           HAS_SCALE, HAS_DELTA, hs)  # fmt: skip
        elif SPLIT == 1:
            _down_epilogue(acc, e, pair, valid, cols, col_ok, s_ptr, d_ptr, y_ptr, dim,
                           HAS_SCALE, HAS_DELTA)  # fmt: skip
        else:  # partials [SPLIT, rows, dim]
            n_rows = tl.num_programs(1 if COLUMNS_FIRST else 0) * BM
            at = part_ptr + (pid_s * n_rows + rows[:, None]).to(tl.int64) * dim + cols[None, :]
            tl.store(at, acc, mask=valid[:, None] & col_ok[None, :])

    @triton.jit
    def _down_reduce_kernel(
        part_ptr, s_ptr, y_ptr, pair_ptr, block_expert_ptr, used_ptr, d_ptr, n_pairs, dim,
        HAS_SCALE: tl.constexpr, HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Split-K's partials of fc2 summed in split order, then the epilogue."""
        if PDL:  # launched early (launch_overlap.py): wait for the predecessor first
            gdc_wait()
            gdc_launch_dependents()
        pid_m = tl.program_id(0)
        if pid_m * BM >= tl.load(used_ptr):
            return
        e, rows, pair, valid = _row_block(pid_m, block_expert_ptr, pair_ptr, n_pairs, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < dim
        n_rows = tl.num_programs(0) * BM
        acc = tl.full((BM, BN), 0.0, tl.float32)
        for s in range(0, SPLIT):
            at = part_ptr + (s * n_rows + rows[:, None]).to(tl.int64) * dim + cols[None, :]
            acc += tl.load(at, mask=valid[:, None] & col_ok[None, :], other=0.0)
        _down_epilogue(acc, e, pair, valid, cols, col_ok, s_ptr, d_ptr, y_ptr, dim,
                       HAS_SCALE, HAS_DELTA)  # fmt: skip


def experts_fused(
    x: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    s1: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
    delta: ExpertDelta | None = None,
    *,
    tiles: ExpertTiles | None = None,
    routing: Routing | None = None,
    fp8_act: bool = False,
) -> torch.Tensor:
    """x [N, D], ids [N, k], w1 [E, 2I, D], w2 [E, D, I] (FP8 with row scales s1 [E, 2I],
    s2 [E, D]; 8- or 4-bit with their bf16 scales, `StoredExperts`; or the activations'
    dtype) -> each chosen expert's output [N, k, D];
    ``delta``: an adapter's deltas of the (token, expert) pairs, added in the kernels.
    ``tiles``: the kernels' tiles (default: `pick_tiles` by token count); ``routing``: the
    pairs already grouped in blocks of ``tiles.bm`` rows (default: grouped here, in Triton).
    ``fp8_act``: both products on FP8 units, their inputs (x, then fc1's output) quantized to
    FP8 per row (act_quant.py); needs FP8 weights, no adapter and no split-K."""
    if triton is None:
        raise RuntimeError("the fused expert kernels need Triton")
    stored = StoredExperts.of(w1, s1, w2, s2)
    if fp8_act and (w1.dtype != FP8 or delta is not None):
        raise ValueError("FP8 activations need FP8 expert weights and no adapter")
    n, k = ids.shape
    n_experts, two_width, dim = stored.up_shape
    width = two_width // 2
    if not (w1.is_contiguous() and w2.is_contiguous()):
        raise ValueError("the fused expert kernels need contiguous expert weights")
    x = x.contiguous()
    tiles = tiles or pick_tiles(n)
    if routing is None:
        routing = moe_routing.align_fused(ids, n_experts, tiles.bm)
    elif routing.block_m != tiles.bm:
        raise ValueError(f"routing in blocks of {routing.block_m} rows, tiles of {tiles.bm}")
    pair_ids, block_expert, used = routing.pair_ids, routing.block_expert, routing.used
    bm, n_blocks = tiles.bm, block_expert.shape[0]
    hidden = torch.empty((n_blocks * bm, width), dtype=x.dtype, device=x.device)
    y = torch.empty((n * k, dim), dtype=x.dtype, device=x.device)
    has_scale = w1.dtype == FP8  # FP8 rows scale the sums; 8- and 4-bit weights as widened
    quant = {"QBITS": stored.qbits, "GROUP": stored.group}
    ieee = x.dtype == torch.float32
    dummy = used  # any pointer: the scales (deltas) are not read without HAS_SCALE (HAS_DELTA)
    x_in, x_scale, act_bytes = x, dummy, x.element_size()
    if fp8_act:
        if tiles.up.split > 1 or tiles.down.split > 1:
            raise ValueError(f"FP8 activations take no split-K tiles ({tiles})")
        x_in, x_scale = act_quant.quant_rows(x)
        act_bytes = 1
    flat = ids.reshape(-1)
    # pair p is token p // k's (made only for an adapter: no launches without one)
    tokens = None if delta is None else torch.arange(n * k, device=x.device) // k
    up = None
    if delta is not None and tokens is not None:
        up = _pair_delta(delta("fc1", x[tokens], flat, tokens), x)
    # (the CPU tests' interpreter has no shared memory to fit)
    limit = smem_limit(x.device.index or 0) if x.is_cuda else 1 << 30
    t = fitted(tiles.up, bm, act_bytes, w1.element_size(), 2, limit)
    k_split, part = _split(t, dim, n_blocks * bm, two_width, x.device)
    grid, columns_first = _grid(n_blocks, triton.cdiv(width, t.bn), t.split)
    _up_kernel[grid](
        x_in, w1, dummy if s1 is None else s1, hidden, part, pair_ids, block_expert, used,
        dummy if up is None else up, x_scale, n * k, k, dim, width, k_split,
        HAS_SCALE=has_scale, HAS_DELTA=up is not None, IEEE=ieee, SPLIT=t.split,
        BM=bm, BN=t.bn, BK=t.bk, ACT_FP8=fp8_act, COLUMNS_FIRST=columns_first, **quant,
        num_warps=t.warps, num_stages=t.stages, **launch_overlap.kernel_args(),
    )  # fmt: skip
    if t.split > 1:
        _up_reduce_kernel[(n_blocks, triton.cdiv(width, t.bn))](
            part, dummy if s1 is None else s1, hidden, pair_ids, block_expert, used,
            dummy if up is None else up, n * k, width,
            HAS_SCALE=has_scale, HAS_DELTA=up is not None, SPLIT=t.split, BM=bm, BN=t.bn,
            **launch_overlap.kernel_args(),
        )  # fmt: skip
    down = None
    if delta is not None and tokens is not None:
        h = hidden[_row_of_pair(pair_ids, n * k)]  # each pair's activation, in pair order
        down = _pair_delta(delta("fc2", h, flat, tokens), x)
    h_in, h_scale = hidden, dummy
    if fp8_act:  # fc1's output rows to FP8 (the padding rows stay unwritten and unread)
        h_in, h_scale = act_quant.quant_rows(hidden, pair_ids, n * k)
    t = fitted(tiles.down, bm, act_bytes, w2.element_size(), 1, limit)
    k_split, part = _split(t, width, n_blocks * bm, dim, x.device)
    grid, columns_first = _grid(n_blocks, triton.cdiv(dim, t.bn), t.split)
    _down_kernel[grid](
        h_in, w2, dummy if s2 is None else s2, y, part, pair_ids, block_expert, used,
        dummy if down is None else down, h_scale, n * k, dim, width, k_split,
        HAS_SCALE=has_scale, HAS_DELTA=down is not None, IEEE=ieee, SPLIT=t.split,
        BM=bm, BN=t.bn, BK=t.bk, ACT_FP8=fp8_act, COLUMNS_FIRST=columns_first, **quant,
        num_warps=t.warps, num_stages=t.stages, **launch_overlap.kernel_args(),
    )  # fmt: skip
    if t.split > 1:
        _down_reduce_kernel[(n_blocks, triton.cdiv(dim, t.bn))](
            part, dummy if s2 is None else s2, y, pair_ids, block_expert, used,
            dummy if down is None else down, n * k, dim,
            HAS_SCALE=has_scale, HAS_DELTA=down is not None, SPLIT=t.split, BM=bm, BN=t.bn,
            **launch_overlap.kernel_args(),
        )  # fmt: skip
    return y.view(n, k, dim)


def _split(
    t: Tile, depth: int, rows: int, cols: int, device: torch.device
) -> tuple[int, torch.Tensor]:
    """K per split (whole BK steps) and the fp32 partials [split, rows, cols] (a one-element
    stand-in without split-K)."""
    if t.split == 1:
        return depth, torch.empty(1, dtype=torch.float32, device=device)
    per = -(-depth // t.split)
    per = -(-per // t.bk) * t.bk
    return per, torch.empty((t.split, rows, cols), dtype=torch.float32, device=device)


def _pair_delta(d: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A delta as the kernels read it: contiguous, in the activations' dtype."""
    return None if d is None else d.to(x.dtype).contiguous()


def _row_of_pair(pair_ids: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """The inverse of `moe_routing.align`'s pair index: each pair's sorted row [n_pairs] (a
    scatter, no host read; the padding rows all land in one spare entry, dropped)."""
    inv = torch.empty(n_pairs + 1, dtype=torch.int64, device=pair_ids.device)
    rows = torch.arange(pair_ids.shape[0], device=pair_ids.device)
    return inv.scatter_(0, pair_ids.long(), rows)[:n_pairs]
