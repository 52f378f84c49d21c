"""Grouped LoRA for a batch whose tokens use different adapters (Triton, CUDA).

Each token carries a slot of the stacked adapter weights (-1: none); ``v = x @ A[slot]^T``
(shrink), then ``v @ B[slot]^T`` (expand) added to a layer's output. Two forms:

* per slot (`shrink`, `expand`: the decoder's adapter path). Programs are per (slot, block of
  tokens, block of K or of N): a program works only when its block holds a token of its slot,
  masks the rest (masked loads fetch nothing), and reads each weight tile once for all of that
  slot's tokens in the block, on the tensor cores. Every output element is written by exactly
  one program (its token's slot's) and every sum runs in a fixed order: deterministic without
  atomics, each token's result independent of the rest of the batch. `shrink` splits K over
  programs and writes fp32 partial products per split; A may stack several targets' ranks
  (targets sharing an input: one launch for all). `expand` sums a token's partials in split
  order, rounds ``v`` to the weights' dtype (as the reference's ``F.linear`` does) and adds
  ``v @ B^T`` in place into up to two outputs in one launch (each its own partials, columns
  of them, B and output), or both into one output (proj's and fc2's, whose outputs are summed
  anyway); with ``gelu`` the second output then goes through GELU, its rows without an adapter
  too (one more program per block for them), so the decoder needs no separate activation
  pass. With ``shrink_after`` (fc2's A) the second output's programs of each slot also
  multiply their finished tiles (as stored) by the slot's A^T: the next layer's shrink as
  fp32 partials per block of `SHRINK_COLS` columns, without a launch or a read of its own.
* per token (`grouped_lora`: single targets, image prefixes' riding prompts, and Moondream 3's
  (token, expert) rows over thousands of stacked pairs, too many for a program per pair): one
  program per (token, block of K), then per (token, block of N), as partial products summed
  in a fixed order.

Both read the slots on the device and launch grids that depend only on the shapes, so a CUDA
graph captures them; the weights are read from the bank's fixed-address buffers at replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_server.chips import ChipSpec, Launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None


if triton is not None:

    @triton.jit
    def _gelu(u):
        # GELU, tanh approximation, as 0.5 (1 + tanh(z)) = sigmoid(2 z); the clamp keeps e^(-2z)
        # finite (u / e^80 is 0 to fp32 for any activation)
        z = 0.7978845608028654 * (u + 0.044715 * u * u * u)
        return u / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))

    # The per-token form (`grouped_lora`).
    @triton.jit
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        idx_ptr,
        v_ptr,
        K,
        stride_xt,
        stride_as,
        stride_ar,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        # One program per (token, block of K): the partial products land apart and the
        # expand sums them in a fixed order (deterministic, unlike atomics).
        t = tl.program_id(0)
        kb = tl.program_id(1)
        slot = tl.load(idx_ptr + t)
        valid = slot >= 0
        safe = tl.maximum(slot, 0).to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = (ks < K) & valid
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + ks, mask=kmask, other=0.0)
        a = tl.load(
            a_ptr + safe * stride_as + rs[:, None] * stride_ar + ks[None, :],
            mask=(rs[:, None] < R) & kmask[None, :],
            other=0.0,
        )
        part = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(v_ptr + (t.to(tl.int64) * SPLITS + kb) * BLOCK_R + rs, part)

    @triton.jit
    def _expand_kernel(
        v_ptr,
        b_ptr,
        idx_ptr,
        y_ptr,
        N,
        stride_bs,
        stride_bn,
        R: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ADD: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        slot = tl.load(idx_ptr + t)
        valid = slot >= 0
        safe = tl.maximum(slot, 0).to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < N
        splits = tl.arange(0, SPLITS)
        parts = tl.load(v_ptr + (t.to(tl.int64) * SPLITS + splits[:, None]) * BLOCK_R + rs[None, :])
        v = tl.sum(parts, axis=0)
        b = tl.load(
            b_ptr + safe * stride_bs + ns[:, None] * stride_bn + rs[None, :],
            mask=nmask[:, None] & (rs[None, :] < R) & valid,
            other=0.0,
        )
        y = tl.sum(b.to(tl.float32) * v[None, :], axis=1)
        at = y_ptr + t.to(tl.int64) * N + ns
        if ADD:  # into the layer's output: rows without an adapter keep theirs exactly
            y += tl.load(at, mask=nmask, other=0.0).to(tl.float32)
        tl.store(at, y.to(y_ptr.dtype.element_ty), mask=nmask)

    # Only core builtins and this module's helpers below (no `tl.max`, `tl.zeros`: the
    # standard library's are jitted where Triton was imported, so the CPU tests' interpreted
    # copy of this module could not call them).
    @triton.jit
    def _larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _any(mask):
        """Whether any lane of the 1-d ``mask`` is set (a scalar)."""
        return tl.reduce(mask.to(tl.int32), 0, _larger) > 0

    @triton.jit
    def _lowrank(
        parts,
        stride_s,
        splits,
        b_tile,
        vmask,
        bmask,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """``v @ B^T`` for a tile: ``parts`` points at the rows' partial products (split 0),
        ``b_tile`` at B^T's [BLOCK_R, BLOCK_N] tile."""
        v = tl.full((BLOCK_T, BLOCK_R), 0.0, tl.float32)
        # (Unrolled, every split's load in flight at once, this took twice as long on an H100.)
        for s in range(SPLITS):  # the splits in order: the same sum every time
            # (not vmask & (s < splits): int32 in Triton 3.6's interpreter, see the expand)
            v += tl.load(parts + s * stride_s, mask=tl.where(s < splits, vmask, False), other=0.0)
        b = tl.load(b_tile, mask=bmask, other=0.0)
        return tl.dot(v.to(b.dtype), b, input_precision=PRECISION)

    @triton.jit
    def _group_shrink_kernel(
        x_ptr,
        a_ptr,
        idx_ptr,
        v_ptr,
        sum_ptr,
        count_ptr,
        T,
        K,
        stride_xt,
        stride_as,
        stride_ar,
        R: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ITERS: tl.constexpr,
        SPLITS: tl.constexpr,
        REDUCE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # REDUCE (one block of tokens): the last of a slot's programs to finish (a count per
        # slot) sums its splits in split order into ``sum_ptr`` [T, BLOCK_R]: the expands then
        # read one split instead of summing them in every program.
        slot = tl.program_id(0)
        ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(2)
        mine = tl.load(idx_ptr + ts, mask=ts < T, other=-1) == slot
        if _any(mine):
            rows = ts.to(tl.int64)
            rs = tl.arange(0, BLOCK_R)
            a_slot = a_ptr + slot.to(tl.int64) * stride_as
            acc = tl.full((BLOCK_T, BLOCK_R), 0.0, tl.float32)
            for i in range(ITERS):
                ks = (split * ITERS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
                kmask = ks < K
                x = tl.load(
                    x_ptr + rows[:, None] * stride_xt + ks[None, :],
                    mask=mine[:, None] & kmask[None, :],
                    other=0.0,
                )
                a = tl.load(
                    a_slot + rs[:, None] * stride_ar + ks[None, :],
                    mask=(rs[:, None] < R) & kmask[None, :],
                    other=0.0,
                )
                acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
            # Rows of other slots are theirs to write; rows without an adapter nobody's (the
            # expand never reads them).
            at = v_ptr + (rows[:, None] * SPLITS + split) * BLOCK_R + rs[None, :]
            tl.store(at, acc, mask=mine[:, None])
            if REDUCE:
                # Every thread's split stored before the count (whose release covers them).
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel")
                tl.debug_barrier()
                if done == SPLITS - 1:
                    v = tl.full((BLOCK_T, BLOCK_R), 0.0, tl.float32)
                    for s in range(SPLITS):
                        at = v_ptr + (rows[:, None] * SPLITS + s) * BLOCK_R + rs[None, :]
                        v += tl.load(at, mask=mine[:, None], other=0.0, cache_modifier=".cg")
                    out = sum_ptr + rows[:, None] * BLOCK_R + rs[None, :]
                    tl.store(out, v, mask=mine[:, None])
                    tl.atomic_xchg(count_ptr + slot, 0)  # ready for the next launch

    @triton.jit
    def _group_expand_kernel(
        v1_ptr,
        b1_ptr,
        y1_ptr,
        v2_ptr,
        b2_ptr,
        y2_ptr,
        a3_ptr,
        v3_ptr,
        idx_ptr,
        T,
        n_slots,
        N1,
        N2,
        NB1,
        col1,
        col2,
        splits1,
        splits2,
        slot_cols1,
        slot_cols2,
        stride_v1,
        stride_v1s,
        stride_v2,
        stride_v2s,
        stride_b1s,
        stride_b1n,
        stride_b2s,
        stride_b2n,
        stride_y1,
        stride_y2,
        stride_a3s,
        stride_a3r,
        stride_v3,
        R: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        GELU: tl.constexpr,
        SUM: tl.constexpr,
        SHRINK: tl.constexpr,
        ITERS2: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # Axis 2 runs over output 1's blocks of N, then output 2's (ITERS2 blocks of BLOCK_N
        # each). Slot ``n_slots`` (present with GELU only) stands for the rows without an
        # adapter: GELU alone, on output 2. SUM: both deltas go into output 1 (axis 2 covers
        # output 1 only). SHRINK: output 2's programs of a slot also multiply their final
        # tiles by the slot's A3^T (the next layer's shrink), partial products per program.
        slot = tl.program_id(0)
        ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        nb = tl.program_id(2)
        two = nb >= NB1
        act = two if GELU else nb < 0  # GELU on this program's output
        # A shrink over every slot (slot_cols > 0: models/common/skinny_gemm.py's, riding a
        # product) holds each slot's columns apart: a row reads its own slot's.
        if nb < NB1:
            v_ptr, b_ptr, y_ptr, n, splits = v1_ptr, b1_ptr, y1_ptr, N1, splits1
            col = col1 + slot * slot_cols1
            stride_v, stride_vs, stride_y = stride_v1, stride_v1s, stride_y1
            stride_bs, stride_bn = stride_b1s, stride_b1n
        else:
            v_ptr, b_ptr, y_ptr, n, splits = v2_ptr, b2_ptr, y2_ptr, N2, splits2
            col = col2 + slot * slot_cols2
            stride_v, stride_vs, stride_y = stride_v2, stride_v2s, stride_y2
            stride_bs, stride_bn = stride_b2s, stride_b2n
            nb -= NB1
        iters = 1 + (ITERS2 - 1) * two.to(tl.int32)  # output 2: ITERS2 blocks of BLOCK_N
        idx = tl.load(idx_ptr + ts, mask=ts < T, other=-2)  # -2: past the tokens, nobody's
        # No token holds slot n_slots: its programs without the GELU take no rows. (A block
        # & a scalar comparison is int32 in Triton 3.6's interpreter, which then refuses it
        # as a mask: the scalars are combined first.)
        mine = tl.where((slot == n_slots) & act, idx == -1, idx == slot)
        if _any(mine):
            rows = ts.to(tl.int64)
            rs = tl.arange(0, BLOCK_R)
            lora = slot < n_slots
            shrink = lora & two
            v3 = tl.full((BLOCK_T, BLOCK_R), 0.0, tl.float32)
            # A constant trip count (a program's own scalar is no loop bound in the
            # interpreter); output 1's programs skip all but the first.
            for i in range(ITERS2):
                if i < iters:
                    ns = (nb * iters + i) * BLOCK_N + tl.arange(0, BLOCK_N)
                    keep = mine[:, None] & (ns < n)[None, :]
                    at = y_ptr + rows[:, None] * stride_y + ns[None, :]
                    y = tl.load(at, mask=keep, other=0.0).to(tl.float32)
                    if lora:
                        vmask = mine[:, None] & (rs < R)[None, :]
                        bmask = (rs < R)[:, None] & (ns < n)[None, :]
                        at_b = slot.to(tl.int64) * stride_bs + ns[None, :] * stride_bn + rs[:, None]
                        y += _lowrank(
                            v_ptr + rows[:, None] * stride_v + col + rs[None, :], stride_vs,
                            splits, b_ptr + at_b, vmask, bmask, BLOCK_T, BLOCK_R, SPLITS,
                            PRECISION,
                        )  # fmt: skip
                        if SUM:
                            at_b = (
                                slot.to(tl.int64) * stride_b2s + ns[None, :] * stride_b2n
                                + rs[:, None]
                            )  # fmt: skip
                            y += _lowrank(
                                v2_ptr + rows[:, None] * stride_v2 + col2 + slot * slot_cols2
                                + rs[None, :], stride_v2s,
                                splits2, b2_ptr + at_b, vmask, bmask, BLOCK_T, BLOCK_R, SPLITS,
                                PRECISION,
                            )  # fmt: skip
                    # out + delta rounded once (the reference rounds the delta first: last
                    # bits).
                    y = y.to(y_ptr.dtype.element_ty)
                    if act:
                        y = _gelu(y.to(tl.float32)).to(y_ptr.dtype.element_ty)
                    tl.store(at, y, mask=keep)
                    if SHRINK and shrink:
                        # The values as stored times A3^T: what a shrink reading them back
                        # computes. Other rows' lanes hold zeros (masked loads), never stored.
                        a3 = tl.load(
                            a3_ptr + slot.to(tl.int64) * stride_a3s + rs[None, :] * stride_a3r
                            + ns[:, None],
                            mask=(ns < n)[:, None] & (rs < R)[None, :], other=0.0,
                        )  # fmt: skip
                        v3 = tl.dot(y, a3, v3, input_precision=PRECISION)
            if SHRINK and shrink:
                # Split ``nb``: output 2's block of columns. Rows of other slots are theirs to
                # write; rows without an adapter nobody's (never read).
                at3 = v3_ptr + rows[:, None] * stride_v3 + nb * BLOCK_R + rs[None, :]
                tl.store(at3, v3, mask=mine[:, None])


@dataclass(frozen=True)
class Partials:
    """`shrink`'s result (or `expand`'s with ``shrink_after``): ``parts`` [T, splits, block_r]
    fp32 partial products of ``x @ A^T`` (rows of tokens without an adapter left unwritten).
    ``slot_cols`` > 0: ``parts`` [T, splits, slots * slot_cols] holds every slot's products
    for every token (a shrink riding a skinny product, models/common/skinny_gemm.py), a
    token reads its slot's."""

    parts: torch.Tensor
    slot_cols: int = 0

    @property
    def splits(self) -> int:
        return self.parts.shape[1]


@dataclass(frozen=True)
class Target:
    """One output of `expand`: ``out`` [T, N] (rows contiguous) plus ``v @ b[slot]^T``, where
    ``v`` is columns ``col : col + rank`` of ``partials`` (of the slot's columns, where they
    hold every slot's) and ``b`` [S, N, rank]."""

    partials: Partials
    col: int
    b: torch.Tensor
    out: torch.Tensor


SPLITS_MAX = 16  # K split over up to this many programs per (slot, block of tokens)
SPLIT_PROGRAMS = 64  # splits per slot over all blocks of tokens, beyond which fewer splits
STAGE_BYTES = 64 << 10  # the shrink's operand tiles, all pipeline stages (fits sm_86/89)
STAGES = 2
REDUCE_STAGES = 4  # a shrink that sums its own splits (a decode step's): its pipeline depth
# Columns of the second output per program of an expand that shrinks after it: fc2's shrink
# then comes in D_ff / SHRINK_COLS splits (16 at moondream2's 8192), each a [rows, rank] fp32
# load that every program of the expand adding fc2's delta sums. Wider: fewer splits to sum,
# but fewer, longer programs for fc1 (8 rank-32 slots at 32 rows: 128 of them, 4 blocks of
# 128 columns each). Unmeasured: the GPU decides.
SHRINK_COLS = 512
# The expand's output columns per program (None: 128 up to 32 tokens, else 64) and its warps.
EXPAND_BLOCK_N: int | None = None
EXPAND_WARPS = 4


def _precision(dtype: torch.dtype) -> str:
    # fp32 weights (tests, fp32 serving) keep full fp32 products; TF32 would drop bits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_t(t: int) -> int:
    return min(64, max(16, triton.next_power_of_2(t)))


def shrink_shape(t: int, k: int, r: int, itemsize: int) -> tuple[int, int, int, int, int]:
    """`shrink`'s launch shape for ``t`` tokens, K ``k``, rank ``r``: (block_t, block_r,
    block_k, K blocks per split, splits); it fixes the order of every sum."""
    block_t, block_r = _block_t(t), max(16, triton.next_power_of_2(r))
    per_k = (block_r + block_t) * itemsize * STAGES
    block_k = max(32, min(128, triton.next_power_of_2(STAGE_BYTES // per_k + 1) // 2))
    n_k, t_blocks = triton.cdiv(k, block_k), triton.cdiv(t, block_t)
    # Many blocks of tokens are parallel enough by themselves: fewer splits keep the partial
    # products of a long prefill chunk small.
    splits = min(SPLITS_MAX, n_k, max(1, SPLIT_PROGRAMS // t_blocks))
    iters = triton.cdiv(n_k, splits)
    return block_t, block_r, block_k, iters, triton.cdiv(n_k, iters)  # no split without K


def _reduce_stages(block_t: int, block_r: int, block_k: int, itemsize: int) -> int:
    # Each split's K blocks all in flight (two stages waited on each in turn: fc2's shrink
    # at 32 rows took 5.9 -> 4.5 us on an H100 with four).
    stage = (block_t + block_r) * block_k * itemsize
    return max(STAGES, min(REDUCE_STAGES, STAGE_BYTES // stage))


def launch_configs(chip: ChipSpec, max_rank: int = 32, targets: int = 3) -> list[Launch]:
    """Every launch `shrink` may pick in 16-bit activations for adapters up to ``max_rank``
    (one target's rank, or ``targets`` stacked), any token count: its tiles keep within
    `STAGE_BYTES` whatever the chip, which every chip of `vlm_server.chips` has."""
    assert chip.limits.shared_per_block >= STAGE_BYTES, f"{chip.name}: shrink tiles too big"
    out: list[Launch] = []
    for r in sorted({max_rank, targets * max_rank}):
        for t in (16, 32, 64, 128):
            block_t, block_r, block_k, _, _ = shrink_shape(t, 1 << 14, r, 2)
            for reduce in (False, True) if t <= block_t else (False,):
                stages = _reduce_stages(block_t, block_r, block_k, 2) if reduce else STAGES
                tiles = {"R": r, "BLOCK_T": block_t, "BLOCK_R": block_r, "BLOCK_K": block_k}
                launch = Launch("_group_shrink_kernel", {**tiles, "REDUCE": reduce}, 4, stages)
                if launch not in out:
                    out.append(launch)
    return out


def shrink(
    x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, count: torch.Tensor | None = None
) -> Partials:
    """``x`` [T, K]; ``a`` [S, R, K] (one layer of the stacked A's, last dim contiguous; R may
    stack several targets' ranks); ``index`` [T] int32 slots (-1: none). ``count`` (one
    block of tokens, T <= 64: int32 zeros, one per slot, left zeros; two launches must not
    share it at once): the splits summed in the launch, in split order (one split returned;
    its pipeline deeper where it fits `STAGE_BYTES`)."""
    t, k = x.shape
    r = a.shape[1]
    assert a.stride(2) == 1 and a.dtype == x.dtype, "A in the activation dtype, K contiguous"
    x = x if x.stride(1) == 1 else x.contiguous()
    block_t, block_r, block_k, iters, splits = shrink_shape(t, k, r, x.element_size())
    parts = torch.empty(t, splits, block_r, dtype=torch.float32, device=x.device)
    out, stages = parts, STAGES
    if count is not None:
        assert t <= block_t and count.numel() >= a.shape[0] and count.dtype == torch.int32
        out = torch.empty(t, 1, block_r, dtype=torch.float32, device=x.device)
        stages = _reduce_stages(block_t, block_r, block_k, x.element_size())
    if t:
        grid = (a.shape[0], triton.cdiv(t, block_t), splits)
        _group_shrink_kernel[grid](
            x, a, index, parts, out, count if count is not None else index, t, k, x.stride(0),
            a.stride(0), a.stride(1), R=r, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k,
            ITERS=iters, SPLITS=splits, REDUCE=count is not None,
            PRECISION=_precision(a.dtype), num_stages=stages,
        )  # fmt: skip
    return Partials(out)


def expand(
    index: torch.Tensor,
    first: Target,
    second: Target | None = None,
    gelu: bool = False,
    same_out: bool = False,
    shrink_after: torch.Tensor | None = None,
) -> Partials | None:
    """Add each target's delta into its ``out`` in place (one launch); ``gelu``: ``second``'s
    output then goes through GELU (tanh), every row of it; ``same_out``: both deltas go into
    ``first.out`` (``second.out`` is the same tensor), summed before one rounding.
    ``shrink_after`` (A [S, R, N2] of the layer reading ``second.out``, R ``second``'s rank):
    that layer's shrink from the finished values in the same launch, returned as partials
    [T, N2 / `SHRINK_COLS` splits, block_r] (rows without an adapter left unwritten)."""
    assert second is not None or not (gelu or same_out), "GELU and sums take a second target"
    assert not (gelu and same_out), "a GELU on a summed output is not wanted anywhere"
    if same_out:
        assert second is not None and second.out.data_ptr() == first.out.data_ptr()
    one = first.out
    two = second if second is not None else first
    t, r = one.shape[0], first.b.shape[2]
    assert two.b.shape[2] == r and two.out.shape[0] == t, "one rank, one batch"
    for target in (first, two):
        assert target.b.stride(2) == 1 and target.out.stride(1) == 1, "contiguous last dims"
        assert target.partials.parts.shape[0] == t
    block_t, block_r = _block_t(t), max(16, triton.next_power_of_2(r))
    block_n = EXPAND_BLOCK_N or (128 if block_t <= 32 else 64)
    n_slots = first.b.shape[0]
    iters2, a3, v3 = 1, two.b, two.partials.parts  # (placeholders without the shrink)
    if shrink_after is not None:
        assert second is not None and not same_out, "the shrink reads the second output"
        a3 = shrink_after
        assert a3.shape == (n_slots, r, two.out.shape[1]) and a3.stride(2) == 1
        assert a3.dtype == two.out.dtype, "the shrink multiplies the stored values"
        iters2 = max(1, SHRINK_COLS // block_n)
        splits3 = triton.cdiv(two.out.shape[1], block_n * iters2)
        v3 = torch.empty(t, splits3, block_r, dtype=torch.float32, device=one.device)
    if t == 0:
        return Partials(v3) if shrink_after is not None else None
    nb1 = triton.cdiv(one.shape[1], block_n)
    nb2 = 0
    if second is not None and not same_out:
        nb2 = triton.cdiv(two.out.shape[1], block_n * iters2)
    assert second is None or second.b.shape[0] == n_slots
    grid = (n_slots + int(gelu), triton.cdiv(t, block_t), nb1 + nb2)
    p1, p2 = first.partials, two.partials
    _group_expand_kernel[grid](
        p1.parts, first.b, one, p2.parts, two.b, two.out, a3, v3, index,
        t, n_slots, one.shape[1], two.out.shape[1], nb1, first.col, two.col,
        p1.splits, p2.splits, p1.slot_cols, p2.slot_cols, p1.parts.stride(0), p1.parts.stride(1),
        p2.parts.stride(0), p2.parts.stride(1),
        first.b.stride(0), first.b.stride(1), two.b.stride(0), two.b.stride(1),
        one.stride(0), two.out.stride(0), a3.stride(0), a3.stride(1), v3.stride(0),
        R=r, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_N=block_n,
        SPLITS=max(p1.splits, p2.splits), GELU=gelu, SUM=same_out,
        SHRINK=shrink_after is not None, ITERS2=iters2, PRECISION=_precision(first.b.dtype),
        num_warps=EXPAND_WARPS,
    )  # fmt: skip
    return Partials(v3) if shrink_after is not None else None


BLOCK_K = 256  # the shrink's K per program: K / BLOCK_K programs per token run in parallel


def grouped_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [T, K]; ``a`` [S, R, K] and ``b`` [S, N, R] (one layer's slice of the stacked
    weights: the last dim contiguous); ``index`` [T] int32 slots (-1: none) -> the delta
    [T, N], or with ``out`` (contiguous [T, N]) ``out`` plus the delta, in place."""
    t, k = x.shape
    _, r, _ = a.shape
    n = b.shape[1]
    assert a.stride(2) == 1 and b.stride(2) == 1, "the stacked weights' last dim is contiguous"
    x = x.contiguous()
    block_r = max(16, triton.next_power_of_2(r))
    splits = triton.next_power_of_2(triton.cdiv(k, BLOCK_K))  # padding splits store zeros
    # Every split is written (padding ones with zeros): no memset needed.
    v = torch.empty(t, splits, block_r, dtype=torch.float32, device=x.device)
    add = out is not None
    if out is not None:
        assert out.shape == (t, n) and out.is_contiguous(), "adds into a contiguous [T, N]"
        y = out
    else:
        y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    _shrink_kernel[(t, splits)](
        x, a, index, v, k, x.stride(0), a.stride(0), a.stride(1),
        R=r, BLOCK_R=block_r, BLOCK_K=BLOCK_K, SPLITS=splits,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(t, triton.cdiv(n, block_n))](
        v, b, index, y, n, b.stride(0), b.stride(1),
        R=r, BLOCK_R=block_r, BLOCK_N=block_n, ADD=add, SPLITS=splits,
    )  # fmt: skip
    return y
